import pytest

from daemon.config import Settings
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
    assert Settings.path_settings() == {"expert_trace_output", "routing_replay"}
