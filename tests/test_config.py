import math

import pytest

from sfi_sglang.method.config import SFIConfig, SFIConfigError, cli_name, parse_layers


def test_defaults_match_spec():
    c = SFIConfig()
    assert (c.sinks, c.window, c.budget) == (4, 256, 2048)
    assert (c.min_gap, c.cooldown, c.max_interval) == (16, 2, 96)
    assert c.dense_layers == (0, 1) and c.bootstrap_rows == 8
    assert c.boundaries == "default" and c.fusion == "arithmetic" and c.refresh == "boundary"
    assert c.alpha == 0.5 and c.key_norm_gamma == 0.5 and c.w_l2 == 1.0 and c.w_pos == 0.7
    assert c.pos_power == 1.8 and c.pos_tail == 0.4
    assert math.isclose(c.pos_beta, 0.5676, rel_tol=1e-3)
    assert (c.lambda_max_single, c.lambda_max_multi) == (0.35, 0.25)
    assert (c.nms_radius, c.nms_strength) == (16, 1.0)
    assert (c.excl_temperature, c.excl_strength) == (2.0, 0.85)
    # measured defaults that differ from the spec (docs/method.md): soft-NMS off,
    # neighbourhood pooling +-3 on
    assert c.use_prior and not c.use_nms and c.use_exclusivity and c.pool_radius == 3
    assert (c.sinks, c.budget) == (4, 2048)


def test_frozen():
    with pytest.raises(Exception):
        SFIConfig().budget = 3


def test_cli_name():
    assert cli_name("min_gap") == "--sfi-min-gap"
    assert cli_name("lambda_max_single") == "--sfi-lambda-max-single"


@pytest.mark.parametrize("kw, needle", [
    (dict(budget=-3), "--sfi-budget must be a positive integer, got -3"),
    (dict(budget=0), "--sfi-budget"),
    (dict(budget=2.5), "--sfi-budget"),
    (dict(budget=True), "--sfi-budget"),
    (dict(window=0), "--sfi-window"),
    (dict(sinks=-1), "--sfi-sinks must be a non-negative integer"),
    (dict(cooldown=-1), "--sfi-cooldown"),
    (dict(min_gap=0), "--sfi-min-gap"),
    (dict(min_gap=200), "--sfi-max-interval (96) must be >= --sfi-min-gap (200)"),
    (dict(bootstrap_rows=0), "--sfi-bootstrap-rows"),
    (dict(fusion="harmonic"), "--sfi-fusion"),
    (dict(refresh="sometimes"), "--sfi-refresh"),
    (dict(boundaries="latin,klingon"), "--sfi-boundaries"),
    (dict(alpha=-0.1), "--sfi-alpha"),
    (dict(alpha=float("nan")), "--sfi-alpha"),
    (dict(w_pos=float("inf")), "--sfi-w-pos"),
    (dict(pos_power=0.0), "--sfi-pos-power"),
    (dict(excl_temperature=0), "--sfi-excl-temperature"),
    (dict(lambda_max_multi=1.5), "--sfi-lambda-max-multi"),
    (dict(nms_radius=-2), "--sfi-nms-radius"),
    (dict(pool_radius=-1), "--sfi-pool-radius"),
    (dict(use_nms="yes"), "--sfi-use-nms"),
    (dict(fast_path="cuda"), "--sfi-fast-path must be 'triton', 'triton-pool' or 'flashinfer'"),
    (dict(dense_layers=(0, -1)), "--sfi-dense-layers"),
    (dict(memory_rows="some"), "--sfi-memory-rows must be a non-negative integer or auto"),
    (dict(memory_rows=-1), "--sfi-memory-rows"),
    (dict(topup_pages=2, page_size=12), "--sfi-page-size must be a power of two with --sfi-topup-pages, got 12"),
])
def test_validation_names_option(kw, needle):
    with pytest.raises(SFIConfigError) as e:
        SFIConfig(**kw)
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_valid_edge_values():
    c = SFIConfig(sinks=0, cooldown=0, nms_radius=0, alpha=0.0, lambda_max_single=1.0,
                  min_gap=96, boundaries="none", fusion="geometric", refresh="interval")
    assert (c.sinks, c.budget) == (0, 2048)


def test_int_for_float_is_coerced():
    c = SFIConfig(alpha=1, w_l2=2)
    assert isinstance(c.alpha, float) and c.alpha == 1.0 and isinstance(c.w_l2, float)


def test_parse_layers():
    assert parse_layers("0,1") == (0, 1)
    assert parse_layers(" 3, 1 ,3") == (1, 3)
    assert parse_layers("") == () and parse_layers("none") == () and parse_layers("None") == ()
    with pytest.raises(SFIConfigError, match="--sfi-dense-layers"):
        parse_layers("0,x")
    assert SFIConfig(dense_layers="2,5").dense_layers == (2, 5)
    assert SFIConfig(dense_layers=[3]).dense_layers == (3,)


def test_from_dict_and_replace():
    c = SFIConfig.from_dict({"budget": 512, "fusion": "geometric", "dense_layers": [0]})
    assert c.budget == 512 and c.fusion == "geometric" and c.dense_layers == (0,)
    assert c.window == 256
    base = SFIConfig(window=64)
    d = SFIConfig.from_dict({"budget": 100}, base=base)
    assert (d.window, d.budget) == (64, 100)
    r = base.replace(min_gap=20)
    assert r.min_gap == 20 and r.window == 64 and base.min_gap == 16
    with pytest.raises(SFIConfigError, match="--sfi-budget"):
        base.replace(budget=-1)
    assert SFIConfig.from_dict(SFIConfig(budget=7).to_dict()) == SFIConfig(budget=7)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(SFIConfigError) as e:
        SFIConfig.from_dict({"budget": 512, "enabled": False})
    msg = str(e.value)
    assert "'enabled'" in msg and "budget" in msg and "min_gap" in msg
    with pytest.raises(SFIConfigError, match="'bugdet'"):
        SFIConfig().replace(bugdet=3)
    with pytest.raises(SFIConfigError):
        SFIConfig.from_dict([("budget", 3)])


@pytest.mark.parametrize("opts, ok", [
    ({"min_gap": 4, "max_interval": 8, "cooldown": 1, "refresh": "interval"}, True),
    ({"dense_layers": [0, 1, 7]}, True),      # a superset of the server's: per-slot mask
    ({"enabled": False}, True),
    ({"dense_layers": [0]}, False),           # drops a server dense layer
    ({"budget": 128}, False),                 # the score/top-k buffers are the server's
    ({"window": 32}, False),
    ({"method": "quest"}, False),
    ({"alpha": 1.0}, False),
])
def test_graph_servers_take_only_device_path_options(monkeypatch, opts, ok):
    """With CUDA graphs (EAGER_ENV "0"), per-request options outside the device step are
    refused with a message that says what to do; eager servers take them all."""
    from sfi_sglang.method.config import SFIConfigError
    from sfi_sglang.method.options import EAGER_ENV, request_config

    server = SFIConfig()
    params = {"sfi": opts}
    monkeypatch.setenv(EAGER_ENV, "1")
    request_config(server, params)
    monkeypatch.setenv(EAGER_ENV, "0")
    if ok:
        request_config(server, params)
    else:
        with pytest.raises(SFIConfigError, match="--disable-cuda-graph"):
            request_config(server, params)


def test_host_path_request_options_need_eager_steps(monkeypatch):
    """The top-up and whole pages per request: taken by an eager server (the CPU engine's,
    or a GPU's, whose host path reads them through the torch reference), refused under
    CUDA graphs naming --disable-cuda-graph; whole pages server-wide on every fast path."""
    from sfi_sglang.method.config import SFIConfigError
    from sfi_sglang.method.options import EAGER_ENV, request_config

    for opts in ({"topup_pages": 2}, {"selection_page": 16}):
        monkeypatch.setenv(EAGER_ENV, "1")
        got = request_config(SFIConfig(), {"sfi": opts})[1]
        assert all(getattr(got, k) == v for k, v in opts.items())
        monkeypatch.setenv(EAGER_ENV, "0")
        with pytest.raises(SFIConfigError, match=f"{next(iter(opts))} need a server launched with --disable-cuda-graph"):
            request_config(SFIConfig(), {"sfi": opts})
    monkeypatch.setenv(EAGER_ENV, "1")
    pages = SFIConfig(selection_page=16)
    assert request_config(pages, {"sfi": {"budget": 512}})[1].selection_page == 16  # the server's
    assert SFIConfig(selection_page=16, fast_path="flashinfer").selection_page == 16


def test_clients_cannot_set_the_internal_boundary_ids_key():
    """custom_params["sfi_extra_boundary_ids"] is what the tokenizer side resolves a
    request's extra_boundaries spec into; a client that sets it gets a 400 (SFIConfigError),
    and custom_params that are not an object stay SGLang's business."""
    from sfi_sglang.integration.hooks import _resolve_extra_boundaries
    from sfi_sglang.method.options import EXTRA_IDS_KEY

    with pytest.raises(SFIConfigError, match="internal"):
        _resolve_extra_boundaries({EXTRA_IDS_KEY: [10**12, -5]})
    _resolve_extra_boundaries([1, 2])
    _resolve_extra_boundaries({"other": 1})


def test_request_options_are_checked_against_the_model(monkeypatch):
    """On the tokenizer side (with the model's shape) a request's dense layers must exist
    and its token counts fit the context length; the server's own values are not re-checked."""
    from sfi_sglang.method.options import EAGER_ENV, ModelLimits, request_config

    monkeypatch.setenv(EAGER_ENV, "1")
    model = ModelLimits(num_layers=30, context_len=8192)
    server = SFIConfig()
    request_config(server, {"sfi": {"dense_layers": [0, 1, 29], "window": 8192}}, model)
    for opts, name in (({"dense_layers": [0, 1, 30]}, "dense_layers"), ({"window": 8193}, "window"),
                       ({"max_interval": 10 ** 12}, "max_interval")):
        with pytest.raises(SFIConfigError, match=name):
            request_config(server, {"sfi": opts}, model)
        request_config(server, {"sfi": opts})  # without the model: the config's own rules only
    request_config(SFIConfig(window=9000), {"sfi": {"budget": 128}}, model)


def test_adaptive_refresh_needs_an_adaptive_server_and_one_tp_rank(monkeypatch):
    """A request's refresh "adaptive" is refused on a server launched without it (its fast
    steps do not report the trigger's log-sum-exp); the server option is refused with tp > 1."""
    from sfi_sglang.method.options import EAGER_ENV, request_config

    monkeypatch.setenv(EAGER_ENV, "0")
    with pytest.raises(SFIConfigError, match="--sfi-refresh adaptive"):
        request_config(SFIConfig(), {"sfi": {"refresh": "adaptive"}})
    adaptive = SFIConfig(refresh="adaptive")
    _, cfg = request_config(adaptive, {"sfi": {"adaptive_threshold": 0.25}})
    assert cfg.refresh == "adaptive" and cfg.adaptive_threshold == 0.25
    assert request_config(adaptive, {"sfi": {"refresh": "boundary"}})[1].refresh == "boundary"
    adaptive.check_server(1)
    SFIConfig().check_server(2)
    with pytest.raises(SFIConfigError, match="--tp-size 1"):
        adaptive.check_server(2)


def test_fp4_kv_cache_is_refused_before_launch():
    """SFI reads K and V in the model's dtype or fp8 (at unit scales): --kv-cache-dtype fp4_*
    stops a launch before any process starts, naming the flag and what to do (Engine here;
    the CLI and the backend call the same check)."""
    import sfi_sglang

    for ok in ("auto", "bf16", "fp8_e4m3", "fp8_e5m2"):
        SFIConfig().check_server(1, ok)
    with pytest.raises(ValueError, match="--kv-cache-dtype fp4_e2m1 is not supported with SFI yet: use"):
        sfi_sglang.Engine(model_path="m", kv_cache_dtype="fp4_e2m1")


def test_memory_rows_auto_follows_the_pool():
    """--sfi-memory-rows auto (the CLI reads it as such, a number as a number): a row for
    every request a pool holds past S + W + K, at most one per request slot; the default;
    a row per request slot on CUDA's packed `triton` path, whose rows also hold K/V."""
    import argparse

    from sfi_sglang.method.config import add_cli_args, config_from_args

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert config_from_args(parser.parse_args(["--sfi-memory-rows", "auto"])).memory_rows == "auto"
    assert config_from_args(parser.parse_args(["--sfi-memory-rows", "7"])).memory_rows == 7
    auto = SFIConfig(memory_rows="auto", sinks=4, window=64, budget=256)  # S + W + K = 324
    assert [auto.rows_for(pool, 2049) for pool in (0, 323, 324, 24368)] == [1, 1, 2, 76]
    assert auto.rows_for(10**9, 65) == 65
    assert SFIConfig(memory_rows=5).rows_for(10**9, 65) == 5 and SFIConfig(memory_rows=0).rows_for(10**9, 65) == 0
    assert SFIConfig().memory_rows == "auto"
    assert SFIConfig(memory_rows=500).rows_for(0, 65) == 65  # never more rows than slots
    # on_device: auto holds where the fast path copies no K/V; on CUDA's packed triton
    # path (a row holds K/V there) it is a row per request slot
    assert auto.on_device(cuda=True) is auto
    assert auto.replace(fast_path="triton").on_device(cuda=False).memory_rows == "auto"
    assert auto.replace(fast_path="triton").on_device(cuda=True).memory_rows == 0
    assert SFIConfig(memory_rows=3, fast_path="triton").on_device(cuda=True).memory_rows == 3
