# The Triton interpreter must be selected before any @triton.jit function is
# defined, i.e. before any kernel module is imported: this file is loaded by
# pytest before every test module.
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# A Ray cluster's raylet starts one idle Python worker per logical CPU for the first driver (8 for the test
# clusters, on 2 cores): ~1.5 CPU-seconds at every cluster start, for workers most tests never use (a stage actor
# that finds none idle starts its own; measured: opening a pipeline is no slower). The clusters the tests start
# (in this process, `ray start`, a CLI or server process) inherit it.
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Under pytest-xdist (`make test` runs one worker per core), each worker gets its share of the cores for
# torch's intra-op threads: two workers each running two threads on two cores spin against each other and
# run several times slower than one thread each. Set before torch is imported (by any test module); the
# processes a test starts (Ray workers, servers) inherit it. Tolerances do not depend on the thread count.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    os.environ.setdefault("MKL_NUM_THREADS", str(_share))

import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

REPO = str(Path(__file__).resolve().parents[1])

# The tiers (markers registered in pyproject.toml). `make test-fast` deselects these and `slow`:
#   ray           needs a Ray cluster: the session's shared one (fixture `ray_cluster`, marked by it) or its own
#   server        starts a server or a cluster node in another process (`omni serve`, `ray start`)
#   real_weights  loads SmolLM2-135M's real weights (fixture `smollm2`, marked by it)
_MARKED_BY_FIXTURE = {"ray_cluster": "ray", "own_ray": "ray", "smollm2": "real_weights"}


# tryfirst: xdist's worker reads each item's group in its own modifyitems hook, so the groups are marked
# before any other plugin's hook runs. (xdist writes the group into the item's node id, which pytest 9.2 no
# longer reads: requirements.txt pins pytest 8.4, under which the groups reach the scheduler.)
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for fixture, marker in _MARKED_BY_FIXTURE.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
    # Items are collected (and grouped) in xdist's workers, where `--dist` reads "no" and `loadgroup` is set.
    if getattr(config.option, "loadgroup", False):
        _group_for_workers(items)
    else:
        # One process: the tests that need the in-process Ray to themselves (fixture `own_ray`) run last, so
        # that the shared cluster starts once and is shut down once, before them (a stable sort).
        items.sort(key=lambda item: "own_ray" in getattr(item, "fixturenames", ()))


OWN_CLUSTER_GROUP = "own-ray-cluster"
OWN_RAY_GROUP = "own-ray"


def _group_for_workers(items: list[pytest.Item]) -> None:
    """Work units for `--dist loadgroup` (pytest-xdist). Every module is a unit of its own, so its
    module-scoped fixtures (pipelines, in-process servers, Ray actors) are built once, on one worker; each
    worker starts its own shared cluster, once, for the Ray modules it gets. The tests that start a Ray
    cluster of their own (marked `ray` without the shared `ray_cluster`: `ray start` heads and nodes, Ray
    Serve, embedded Ray in this process or in a CLI process) are one unit, so no two of them start a head
    at the same time (on 2 cores, a head that starts while another is starting can miss its GCS deadline).

    The units are handed out in this order (`--no-loadscope-reorder`), the longest first, so that the
    last units to finish are short ones and both workers finish together: the own-cluster unit (minutes of
    cluster starts, one after another), then the other Ray modules, then the tests that take this
    process's Ray for themselves (`own_ray`: the two-node replicas, embedded Ray; one unit, after which
    that worker needs no Ray), then the rest, each kind by its number of slow tests. (Handed out last, that
    unit, among the longest, ran alone after the other worker had nothing left, one core idle meanwhile.)"""
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    slow: dict[str, int] = {}  # a module's length, roughly: its tests marked slow
    for item in items:
        slow[module(item)] = slow.get(module(item), 0) + (item.get_closest_marker("slow") is not None)

    def rank(item: pytest.Item) -> tuple[int, int]:
        fixtures = getattr(item, "fixturenames", ())
        ray = item.get_closest_marker("ray") is not None
        if "own_ray" in fixtures:
            return 2, 0
        kind = 0 if ray and "ray_cluster" not in fixtures else 1 if ray else 3
        return kind, -slow[module(item)] if kind in (1, 3) else 0

    items.sort(key=rank)
    for item in items:
        kind = rank(item)[0]
        group = OWN_CLUSTER_GROUP if kind == 0 else OWN_RAY_GROUP if kind == 2 else module(item)
        item.add_marker(pytest.mark.xdist_group(group))


# ------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="session")
def tiny_llama():
    from stages.checkpoints.tiny_lm import tiny_checkpoint

    return tiny_checkpoint("llama")


@pytest.fixture(scope="session")
def tiny_qwen2():
    from stages.checkpoints.tiny_lm import tiny_checkpoint

    return tiny_checkpoint("qwen2")


@pytest.fixture(scope="session")
def tiny_omni():
    from stages.qwen2_5_omni.checkpoint import tiny_omni_checkpoint

    return tiny_omni_checkpoint()


@pytest.fixture(scope="session")
def smollm2():
    from stages.checkpoints.smollm2 import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def shared_causal_lm():
    """Load each (path, dtype, device) causal LM once for the local pipelines of a module (loading the
    tokenizer dominates a tiny stage's start-up; the weights are read-only, the engines their own)."""
    import stages.causal_lm as causal_lm

    original = causal_lm.CausalLMStage.load.__func__
    loaded: dict[tuple[str, str, str], Any] = {}

    def load(cls, model_path, **kw):
        if kw.get("model_kwargs") or kw.get("tokenizer_path"):
            return original(cls, model_path, **kw)
        key = (str(model_path), str(kw["dtype"]), str(kw["device"]))
        if key not in loaded:
            loaded[key] = original(cls, model_path, **kw)
        return loaded[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(causal_lm.CausalLMStage, "load", classmethod(load))
        yield


class TokenizerCache:
    """Every pipeline this process builds loads its stages' tokenizers; the tiny checkpoints' (Qwen2's
    151k-token vocabulary, an 18 MB tokenizer.json) take seconds each. Once installed, transformers' loader
    runs once per (path, options, files' mtimes) for the session and every later load gets that tokenizer:
    omni only reads them (encode, decode, chat templates). Failures are not remembered; Ray actors and
    subprocesses load their own."""

    def __init__(self) -> None:
        self.loaded: dict[tuple[str, str], Any] = {}
        self.restore: Any = None

    def install(self) -> None:
        """Wraps AutoTokenizer.from_pretrained once transformers is imported (a session that never
        imports it does not pay for the import here)."""
        if self.restore is not None or "transformers" not in sys.modules:
            return
        from transformers import AutoTokenizer

        descriptor, original = AutoTokenizer.__dict__["from_pretrained"], AutoTokenizer.from_pretrained

        def from_pretrained(cls, path, *args, **kwargs):
            files = Path(path).iterdir() if Path(path).is_dir() else ()
            written = max((f.stat().st_mtime_ns for f in files), default=0)  # written again: load again
            key = (str(path), repr((args, sorted(kwargs.items()), written)))
            if key not in self.loaded:
                self.loaded[key] = original(path, *args, **kwargs)
            return self.loaded[key]

        AutoTokenizer.from_pretrained = classmethod(from_pretrained)
        self.restore = lambda: setattr(AutoTokenizer, "from_pretrained", descriptor)


@pytest.fixture(scope="session")
def _tokenizer_cache():
    cache = TokenizerCache()
    try:
        yield cache
    finally:
        if cache.restore is not None:
            cache.restore()


class GrammarTokenizerCache:
    """Structured outputs read a stage's tokenizer into llguidance's view of it once per engine
    (omni/engine/io/structured_output.py `_lltokenizer`: seconds for the tiny checkpoints' 151k-token vocabulary).
    The engines of this process share their tokenizers (TokenizerCache), so once installed, that view is built
    once per (tokenizer, vocabulary size, end token) for the session: llguidance only reads it (each request gets
    a matcher of its own). A tokenizer is known by its serialized backend (all that view is made of): the tiny,
    small and k1g2 checkpoints of a family share one. Failures are not remembered; Ray actors and subprocesses
    build their own."""

    def __init__(self) -> None:
        self.digests: dict[int, tuple[Any, str]] = {}  # id -> (the tokenizer, kept: its id is not reused; digest)
        self.built: dict[tuple[str, int, Any], Any] = {}
        self.restore: Any = None

    def digest(self, tokenizer: Any) -> str:
        if id(tokenizer) not in self.digests:
            import hashlib

            text = tokenizer.backend_tokenizer.to_str()
            self.digests[id(tokenizer)] = (tokenizer, hashlib.sha256(text.encode()).hexdigest())
        return self.digests[id(tokenizer)][1]

    def install(self) -> None:
        """Wraps `_lltokenizer` once its module is imported (by the engine: a session that never imports it does
        not pay for the import here)."""
        module = sys.modules.get("omni.engine.io.structured_output")
        if self.restore is not None or module is None:
            return
        original = module._lltokenizer

        def _lltokenizer(tokenizer, vocab_size, eos_token_id):
            eos = eos_token_id if eos_token_id is not None else tokenizer.eos_token_id
            key = (self.digest(tokenizer), int(vocab_size), eos)
            if key not in self.built:
                self.built[key] = original(tokenizer, vocab_size, eos_token_id)
            return self.built[key]

        module._lltokenizer = _lltokenizer
        self.restore = lambda: setattr(module, "_lltokenizer", original)


@pytest.fixture(scope="session")
def _grammar_tokenizer_cache():
    cache = GrammarTokenizerCache()
    try:
        yield cache
    finally:
        if cache.restore is not None:
            cache.restore()


@pytest.fixture(autouse=True)
def _tokenizers_loaded_once(_tokenizer_cache, _grammar_tokenizer_cache):
    _tokenizer_cache.install()
    _grammar_tokenizer_cache.install()


# ------------------------------------------------------------------------ Ray
class SharedRay:
    """The session's one local Ray cluster, for every test that only needs "a Ray" (embedded in this
    process: auth disabled, its own temp dir; the stage actors import this checkout's `tests` package).

    Started on first use; shut down at the end of the session, or earlier by `own_ray` for the tests that
    need the in-process Ray to themselves (those run last), after which the next user starts it again."""

    def __init__(self) -> None:
        self.temp_dir: str | None = None

    def ensure(self) -> Any:
        import ray

        if not ray.is_initialized():
            self.shutdown()
            self.temp_dir = tempfile.mkdtemp(prefix="omni-test-ray-")
            # The stage actors import this checkout's `tests` (fakes): through the environment the raylet
            # inherits and hands its workers, not a runtime_env, whose workers take ~0.6 s longer to start.
            paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if REPO not in paths:
                os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, paths)])
            # Logical CPUs only gate placement: 8 lets a test's stages (and replicas) all place on 2 cores.
            ray.init(address="local", num_cpus=8, include_dashboard=False, _temp_dir=self.temp_dir,
                     log_to_driver=False)
        return ray

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None


@pytest.fixture(scope="session")
def _shared_ray():
    pytest.importorskip("ray")  # GPU machines may run the suite without Ray
    shared = SharedRay()
    try:
        yield shared
    finally:
        shared.shutdown()


@pytest.fixture(scope="module")
def ray_cluster(_shared_ray):
    """The shared local Ray cluster (the `ray` module, initialized). A pipeline opened on it does not own
    it: closing the pipeline kills its actors and waits until they are gone, the cluster stays."""
    return _shared_ray.ensure()


@pytest.fixture(scope="module")
def own_ray(_shared_ray):
    """For a module that starts (or connects) the in-process Ray itself: the shared cluster is shut
    down first (these modules run last), and whatever Ray the module left is shut down after it."""
    _shared_ray.shutdown()
    ray = pytest.importorskip("ray")
    try:
        yield ray
    finally:
        if ray.is_initialized():
            ray.shutdown()


@pytest.fixture(autouse=True)
def _ray_needs_the_marker(request: pytest.FixtureRequest):
    """A test not marked `ray` must not start Ray (it would run, slowly, in `make test-fast`): `ray.init`
    fails it, naming the fixture to use."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    try:
        import ray
    except ImportError:
        yield
        return

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"{request.node.nodeid} starts Ray but is not marked `ray`: use the fixture "
                           "`ray_cluster` (the session's shared cluster) or `own_ray`, or mark it")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray, "init", refuse)
        yield
