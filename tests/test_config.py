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
