"""The method: SFI's config, boundary policy, Selector, sparse memory and decode-step plan,
with no SGLang import."""
