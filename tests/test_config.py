from dataclasses import fields

import pytest

from daemon.config import Settings, allowed_uid_set
from daemon.errors import ConfigError


def test_defaults_env_and_overrides():
    assert Settings.load(env={}).numerics == "ggml"
    assert Settings.load(env={"MOE_NUMERICS": "float32"}).numerics == "float32"
    assert Settings.load(env={"MOE_NUMERICS": "float32"}, numerics="ggml").numerics == "ggml"
    assert Settings.load(env={"MOE_N_CTX": "512"}).n_ctx == 512


@pytest.mark.parametrize("env", [{"MOE_NUMERICS": "fp8"}, {"MOE_N_CTX": "lots"}, {"MOE_N_THREADS": "-1"}])
def test_bad_env_values_are_named(env):
    with pytest.raises(ConfigError, match=next(iter(env))):
        Settings.load(env=env)


def test_unknown_setting_rejected():
    with pytest.raises(ConfigError, match="numerix"):
        Settings.load(env={}, numerix="ggml")


def test_every_setting_is_described():
    rows = Settings.describe()
    assert {r[0] for r in rows} >= {"numerics", "n_ctx", "n_threads"}
    assert all(r[1] and r[3] for r in rows)


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400"])
def test_non_finite_numbers_rejected(value):
    with pytest.raises(ConfigError, match="EXPERT_CACHE_LIMIT_MB"):
        Settings.load(env={"EXPERT_CACHE_LIMIT_MB": value})
    with pytest.raises(ConfigError, match="expert_cache_limit_mb"):
        Settings.load(env={}, expert_cache_limit_mb=float(value))


def test_nul_in_a_string_setting_rejected():
    with pytest.raises(ConfigError, match="NUL"):
        Settings.load(env={}, expert_trace_output="a\0b")


def test_daemon_and_path_settings_are_flagged():
    assert {"socket", "allowed_uids", "max_connections", "max_prompt_bytes"} <= Settings.daemon_settings()
    assert "n_ctx" not in Settings.daemon_settings()
    assert Settings.path_settings() == {"expert_trace_output", "routing_replay", "kernel_cache", "models"}
    assert "kernel_cache" in Settings.daemon_settings()  # process-wide: never one model's


def test_env_value_reads_one_setting_alone():
    env = {"MOED_KERNEL_CACHE": "off", "MOE_N_CTX": "lots"}  # another setting's bad value is not its error
    assert Settings.env_value("kernel_cache", env) == "off"
    assert Settings.env_value("kernel_cache", {}) == "on"
    with pytest.raises(ConfigError, match="MOED_KERNEL_CACHE"):
        Settings.env_value("kernel_cache", {"MOED_KERNEL_CACHE": "cache"})


# -- issue 25: every number has a range; MOED_ALLOWED_UIDS and MOED_MAX_FRAME checked at start -----

NUMERIC = [f for f in fields(Settings) if f.type in ("int", "float")]


def test_every_numeric_setting_has_a_range():
    bounds = Settings.bounds()
    assert {f.name for f in NUMERIC} <= bounds.keys()
    # and so does every string setting that takes a number (auto or N)
    assert {"gpu_cache_mb", "offload_min_batch"} <= bounds.keys()


@pytest.mark.parametrize("f", NUMERIC, ids=lambda f: f.name)
def test_out_of_range_fails_from_the_environment_and_as_an_override(f):
    lo, hi = Settings.bounds()[f.name]
    env = f.metadata["env"]
    for bad in (lo - 1, hi * 2 + 1):
        with pytest.raises(ConfigError, match=f"{env}: .*out of range"):
            Settings.load(env={env: str(bad)})
        with pytest.raises(ConfigError, match=f"{f.name}: .*out of range"):
            Settings.load(env={}, **{f.name: bad})
    for good in (lo, hi):  # the ends are inside
        assert getattr(Settings.load(env={env: str(good)}), f.name) == good


def test_io_depth_of_the_probe_is_refused():
    for value in (300000, 10**7, 0):
        with pytest.raises(ConfigError, match="io_depth"):
            Settings.load(env={}, io_depth=value)
    assert Settings.load(env={}, io_depth=1024).io_depth == 1024


@pytest.mark.parametrize("value", ["1_000", "\u0660", "\u0661\u0662", "１２", "2.5", "0x10"])
def test_numbers_are_ascii_decimal(value):
    with pytest.raises(ConfigError, match="MOE_N_CTX: expected int"):
        Settings.load(env={"MOE_N_CTX": value})


def test_a_fractional_int_override_is_not_cut():
    with pytest.raises(ConfigError, match="io_depth: expected int"):
        Settings.load(env={}, io_depth=2.5)
    assert Settings.load(env={}, io_depth=2.0).io_depth == 2


@pytest.mark.parametrize("env,value", [("MOE_GPU_CACHE_MB", "2000000"), ("MOE_OFFLOAD_MIN_BATCH", "99999999999")])
def test_number_valued_strings_have_a_range(env, value):
    with pytest.raises(ConfigError, match=f"{env}: .*out of range"):
        Settings.load(env={env: value})
    assert Settings.load(env={env: "auto"}) and Settings.load(env={env: "12"})


@pytest.mark.parametrize("value", ["0", "10", "65536"])
def test_max_frame_too_small_for_a_reply_fails_at_start(value):
    with pytest.raises(ConfigError, match="MOED_MAX_FRAME"):
        Settings.load(env={"MOED_MAX_FRAME": value})


def test_max_frame_minimum_holds_a_stats_reply():
    """The minimum must hold the largest reply the daemon sends that no client sized: stats of
    several large models (94 MoE layers; cache, VRAM cache and routing tables per layer)."""
    from daemon.storage.cache import LayerStats
    from ipc.protocol import StatsReply, encode

    lo = Settings.bounds()["max_frame"][0]
    layer = {k: 10**12 for k in LayerStats().as_dict()} | {"capacity": 512, "cached": 512}
    model = {part: {"layers": {il: dict(layer) for il in range(94)}} for part in ("cache", "vram_cache", "routing")}
    reply = StatsReply(2**40, {f"/models/{'m' * 200}-{i}.gguf": model for i in range(4)})
    assert len(encode(reply)) < lo
    assert Settings.load(env={"MOED_MAX_FRAME": str(lo)}).max_frame == lo


@pytest.mark.parametrize("spec", [",", " ", " , ", "-1", "1_000", "\u0660", "1000,", ",1000", "1000,,1001",
                                  "1000;1001", "+5", "4294967295", "99999999999", "1000 1001", "\t1000",
                                  "1" * 5000])  # past int()'s 4300 digits: a ValueError, not a ConfigError
def test_bad_allowed_uids_fail_at_start(spec):
    with pytest.raises(ConfigError, match="MOED_ALLOWED_UIDS"):
        Settings.load(env={"MOED_ALLOWED_UIDS": spec})
    with pytest.raises(ConfigError, match="allowed_uids"):
        Settings.load(env={}, allowed_uids=spec)
    with pytest.raises(ConfigError, match="MOED_ALLOWED_UIDS"):
        allowed_uid_set(spec)


@pytest.mark.parametrize("spec,uids", [("", set()), ("0", {0}), ("65534", {65534}),
                                       ("1000, 1001 ,1002", {1000, 1001, 1002}), ("4294967294", {2**32 - 2})])
def test_allowed_uids_parse(spec, uids):
    assert Settings.load(env={}, allowed_uids=spec).allowed_uids == spec
    assert allowed_uid_set(spec) == uids
