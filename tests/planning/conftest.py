import pytest

from omni.planning.budget import GiB, MachineProbe


def fake_probe(host_gb: float = 64.0, gpus: tuple[tuple[float, float], ...] = ()) -> MachineProbe:
    """A machine with `host_gb` of available RAM and GPUs of (free GiB, total GiB): no real device asked."""
    return MachineProbe(lambda: (int(host_gb * GiB), "fake host"), lambda: len(gpus),
                        lambda i: (int(gpus[i][0] * GiB), int(gpus[i][1] * GiB)))


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty profile store of the test's own (Omni reads the default one: $OMNI_PROFILE_DIR)."""
    from omni.planning.profile_store import ProfileStore

    monkeypatch.setenv("OMNI_PROFILE_DIR", str(tmp_path / "profiles"))
    return ProfileStore()
