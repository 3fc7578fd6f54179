"""A Load setting out of its range is a bad_request at once: nothing is loaded, no thread started
(issue 25: io_depth=300000 took 4.6 s and 315 MB, 10**7 never answered)."""

from __future__ import annotations

import pytest

from daemon.scheduler import Scheduler, SchedulerError
from tests.scheduler.test_scheduler import Factory, settings


@pytest.mark.parametrize("bad", [{"io_depth": 300000}, {"io_depth": 10**7}, {"io_depth": 0}, {"n_threads": 10**6},
                                 {"n_ctx": 2**40}, {"postfetch_max_transfers": 10**9}, {"gpu_cache_mb": "9" * 30}])
async def test_out_of_range_load_settings_are_bad_requests_before_any_work(tmp_path, bad):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")  # exists: the refusal must come before the file is even looked at
    factory = Factory()
    s = Scheduler(settings(), factory=factory)
    try:
        with pytest.raises(SchedulerError) as e:
            await s.load(str(model), bad)
        assert e.value.code == "bad_request" and next(iter(bad)) in str(e.value) and "range" in str(e.value)
        assert factory.calls == 0 and s.registry.models == {}
    finally:
        await s.close()
