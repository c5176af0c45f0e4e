"""restore_latest_params (the restore eval and generate share, in the library since it left the eval
CLI): no checkpoint or another model's is a RestoreFailed with exit code 2, an unreadable one the
checkpoint exit code, and the checkpointer is closed on every path. No compile: a stand-in
Checkpointer and setup."""
import pytest

from jaxtrain.checkpoints import checkpointer as checkpointer_module
from jaxtrain.checkpoints.errors import CheckpointError, IncompatibleCheckpoint
from jaxtrain.resilience import exit_codes
from jaxtrain.training.restore_latest import RestoreFailed, restore_latest_params

pytestmark = [pytest.mark.fast]


class _Restored:
    step, params = 7, {"w": 1.0}


class _Setup:
    def __init__(self, outcome):
        self.outcome, self.calls = outcome, []

    def restore(self, checkpointer, **kwargs):
        self.calls.append(kwargs)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        return self.outcome


@pytest.fixture
def fake_checkpointer(monkeypatch):
    opened = []

    class FakeCheckpointer:
        latest = 7

        def __init__(self, directory):
            self.directory, self.closed = directory, False
            opened.append(self)

        def latest_step(self):
            return self.latest

        def close(self):
            self.closed = True

    monkeypatch.setattr(checkpointer_module, "Checkpointer", FakeCheckpointer)
    return FakeCheckpointer, opened


def test_returns_the_newest_step_and_params_through_setup_restore(fake_checkpointer, tmp_path):
    _, opened = fake_checkpointer
    setup = _Setup(_Restored())
    assert restore_latest_params(setup, str(tmp_path), True, as_saved=False) == (7, {"w": 1.0})
    assert setup.calls == [dict(params_only=True, as_saved=False, quarantine=False, allow_unverified=True)]
    assert opened[0].directory == str(tmp_path / "checkpoints") and opened[0].closed


@pytest.mark.parametrize("outcome, code, words", [
    (None, 2, "no checkpoint in"),
    (IncompatibleCheckpoint("written by another model"), 2, "written by another model"),
    (CheckpointError("step 7 is corrupt"), exit_codes.CHECKPOINT, "step 7 is corrupt"),
])
def test_each_failure_names_itself_with_its_exit_code(fake_checkpointer, tmp_path, outcome, code, words):
    cls, opened = fake_checkpointer
    if outcome is None:
        cls.latest = None
    with pytest.raises(RestoreFailed, match=words) as caught:
        restore_latest_params(_Setup(outcome), str(tmp_path), False)
    assert caught.value.exit_code == code
    assert opened[0].closed
