# Source this on the device machine (no pip install there): sfi_site DIR lays out
# sfi_sglang in DIR as its wheel installs it (kernels/ and router/ as its subpackages
# sfi_sglang.kernels and sfi_sglang.router) and puts DIR first on PYTHONPATH. Run Python
# with -P there, so the checkout's own sfi_sglang/ (without those subpackages) does not
# shadow it.
sfi_site() {
  local site=$1 repo=${2:-$PWD}
  rm -rf "$site/sfi_sglang" && mkdir -p "$site/sfi_sglang"
  cp -r "$repo"/sfi_sglang/. "$site/sfi_sglang/"
  cp -r "$repo"/kernels "$site/sfi_sglang/kernels"
  cp -r "$repo"/router "$site/sfi_sglang/router"
  find "$site/sfi_sglang" -name __pycache__ -prune -exec rm -rf {} +
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
}
