"""Names -> import strings: stage models, input processors, model path schemes.

omni never imports model code: a config names a stage model ("causal_lm"), an
input processor ("hidden_to_embeds") or a model path ("builtin:tiny-qwen2"),
and this registry maps the name to a "package.module:attr" string that is
imported only when an engine is built (as vLLM's model registry does). The
facts a config validator needs travel with each entry, so that validating a
config imports neither torch nor any model:

    stage model      target, info (the "package.module:NAME" of its omni.stage_info.StageInfo:
                     autoregressive, emits_hidden_states, streams_input, ...), checkpoint (loads
                     weights from model_path: the path is checked before start)
    input processor  target, needs_hidden_states (reads the upstream's per-token rows),
                     incremental (the chunk form a streaming edge uses; None: not streamable)
    path scheme      "builtin" -> target of fn(name) -> Path, and of fn(name) that checks a
                     name without building anything (optional)

A stage model's facts are declared once, as one StageInfo object in a torch-free module of its
family (e.g. stages/qwen2_5_omni/info.py): its class points at it (`info = TOKEN2WAV`), and its
registration names that same object (`info="stages.qwen2_5_omni.info:TOKEN2WAV"`, imported when the
name is first looked up, as the class is when an engine is built). So the validator reads exactly
what the engine runs by without importing the class (and torch), and there is no second copy to
drift. A model whose facts are all StageInfo's defaults (a plain decoder LM) declares nothing. A
config may also name a target directly ("pkg.mod:Cls"); such a target is imported to read its
class's `info`.

Model packages register themselves through a plugin: "package.module:function",
called once before the first lookup. The default plugin is this repository's
`stages` package; $OMNI_PLUGINS (comma-separated) replaces the list.

A Ray actor does not see registrations made in the driver at run time;
`snapshot()` / `restore()` carry them over (the Ray backend does this).
"""
from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from omni.errors import OmniError
from omni.stage_info import StageInfo

PLUGINS_ENV = "OMNI_PLUGINS"
DEFAULT_PLUGINS = ("stages:register",)


@dataclass(frozen=True, slots=True)
class StageModelEntry:
    target: str  # "package.module:Class"
    info: StageInfo = StageInfo()  # the class's own `info` (the same object: declared once)
    checkpoint: bool = True  # loads weights from model_path (False: test doubles; the path is not checked)


@dataclass(frozen=True, slots=True)
class _StageModelRegistration:
    """A registered stage model before its info is imported (what snapshot() carries)."""

    target: str
    info: str | None  # "package.module:NAME" of its StageInfo; None: StageInfo's defaults
    checkpoint: bool


@dataclass(frozen=True, slots=True)
class InputProcessorEntry:
    target: str  # "package.module:function"
    # True when the processor reads the upstream's per-token rows (hidden states,
    # mm_outputs): the upstream stage must then hand them over for every request.
    # None: not known (a target given directly): they are handed over, nothing is checked.
    needs_hidden_states: bool | None = False
    # "package.module:function" of the chunk form, for streaming edges:
    #   fn(chunk: StageDelta, request: StageInput, state) -> StageInput | None
    # `chunk` carries the upstream's new tokens (and, for processors that read rows, the
    # rows of the tokens computed since the last chunk); the StageInput returned holds
    # the prompt part this chunk adds (its typed side input in `payload`), None while the
    # request cannot start yet. `state` persists across one request's chunks.
    # None: the processor cannot stream.
    incremental: str | None = None
    # "package.module:Class" of that state (made with no arguments, once per request); None: a dict.
    chunk_state: str | None = None


_STAGE_MODELS: dict[str, _StageModelRegistration] = {}
_INPUT_PROCESSORS: dict[str, InputProcessorEntry] = {
    # omni's own default: the upstream generated token ids become the prompt.
    "passthrough_tokens": InputProcessorEntry("omni.pipeline.stage_worker:passthrough_tokens",
                                              incremental="omni.pipeline.stage_worker:passthrough_tokens_chunk"),
}
_PATH_SCHEMES: dict[str, str] = {}
_PATH_CHECKS: dict[str, str] = {}
_plugins_loaded = False
_plugins_lock = threading.Lock()


# ------------------------------------------------------------------ plugins
def load_plugins() -> None:
    """Run every plugin's register function once per process (idempotent, thread-safe)."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    with _plugins_lock:
        if _plugins_loaded:
            return
        env = os.environ.get(PLUGINS_ENV)
        specs = [s.strip() for s in env.split(",") if s.strip()] if env is not None else list(DEFAULT_PLUGINS)
        for spec in specs:
            try:
                register = import_target(spec)
                register()
            except Exception as e:  # noqa: BLE001 - report which plugin, whatever went wrong
                raise OmniError(f"omni plugin {spec!r} ({PLUGINS_ENV}) failed to load: "
                                f"{type(e).__name__}: {e}") from e
        _plugins_loaded = True


# -------------------------------------------------------------- registering
def is_target(name: str) -> bool:
    """True for a "module:attr" string (as opposed to a registered name)."""
    return isinstance(name, str) and ":" in name


def _check_name(kind: str, name: str, target: str) -> None:
    if not isinstance(name, str) or not name or is_target(name):
        raise ValueError(f"{kind} name must be a non-empty str without ':', got {name!r}")
    if not is_target(target):
        raise ValueError(f"{kind} {name!r}: target must be a 'package.module:attr' string, got {target!r}")


def register_stage_model(name: str, target: str, *, info: str | None = None, checkpoint: bool = True) -> None:
    """Register a stage model class by its "module:Class" string (not imported here); `info`: the
    "module:NAME" string of the StageInfo object the class declares as its `info` (in a torch-free module;
    not imported here either), None for a class that keeps StageInfo's defaults."""
    _check_name("stage model", name, target)
    if info is not None and not is_target(info):
        raise ValueError(f"stage model {name!r}: info must be a 'package.module:NAME' string, got {info!r}")
    _STAGE_MODELS[name] = _StageModelRegistration(target, info, checkpoint)


def register_input_processor(name: str, target: str, *, needs_hidden_states: bool = False,
                             incremental: str | None = None, chunk_state: str | None = None) -> None:
    """Register an input processor by its "module:function" string (not imported here).

    The function: fn(upstream: dict[str, StageOutput], request: StageInput) -> StageInput, where
    `upstream` holds one entry per name in the downstream stage's `inputs`, in that order, and
    `request` is the user's original input. `incremental`: the chunk form (see InputProcessorEntry),
    which lets the processor sit on a streaming edge; `chunk_state`: the class of its per-request state.
    """
    _check_name("input processor", name, target)
    for what, value in (("incremental", incremental), ("chunk_state", chunk_state)):
        if value is not None and not is_target(value):
            raise ValueError(f"input processor {name!r}: {what} must be a 'package.module:name' string, got {value!r}")
    _INPUT_PROCESSORS[name] = InputProcessorEntry(target, needs_hidden_states, incremental, chunk_state)


def register_model_path_scheme(scheme: str, target: str, *, check: str | None = None) -> None:
    """Model paths "scheme:NAME" resolve through fn(NAME) -> Path at `target` (e.g. builtin:smollm2);
    `check`: fn(NAME) that raises ValueError for a NAME the scheme does not know, building nothing."""
    _check_name("model path scheme", scheme, target)
    _PATH_SCHEMES[scheme] = target
    if check is not None:
        _check_name("model path scheme check", scheme, check)
        _PATH_CHECKS[scheme] = check


# ------------------------------------------------------------------ lookups
def stage_model_entry(name: str) -> StageModelEntry:
    """The entry of a registered name; for a "module:Class" target, the class's `info` (it is imported).

    Raises KeyError (unknown name) or ValueError (a target that does not import / is no class / declares no
    StageInfo).
    """
    if is_target(name):
        cls = _resolve_target(name, "a class", lambda o: isinstance(o, type))
        info = getattr(cls, "info", None)  # the target is any class: checking that it declares one
        if not isinstance(info, StageInfo):
            raise ValueError(f"{name!r}: {cls.__name__} declares no StageInfo as its `info` "
                             "(subclass omni.engine.stage_model's StageModel)")
        return StageModelEntry(name, info)
    reg: _StageModelRegistration = _registered(_STAGE_MODELS, "stage model", name, "package.module:Class")
    info = (StageInfo() if reg.info is None
            else _resolve_target(reg.info, "a StageInfo", lambda o: isinstance(o, StageInfo)))
    return StageModelEntry(reg.target, info, reg.checkpoint)


def input_processor_entry(name: str) -> InputProcessorEntry:
    """The entry of a registered name; a "module:function" target is imported to check it is callable."""
    if is_target(name):
        fn = _resolve_target(name, "callable", callable)
        # A function given directly streams when it carries its chunk form as `fn.incremental`.
        inc = getattr(fn, "incremental", None)
        return InputProcessorEntry(name, needs_hidden_states=None,
                                   incremental=f"{inc.__module__}:{inc.__qualname__}" if callable(inc) else None)
    return _registered(_INPUT_PROCESSORS, "input processor", name, "package.module:function")


def _registered(table: dict[str, Any], kind: str, name: str, target_form: str) -> Any:
    load_plugins()
    if name not in table:
        raise KeyError(f"unknown {kind} {name!r}; registered: {sorted(table)} (or give '{target_form}')")
    return table[name]


def resolve_stage_model(name: str) -> type:
    """Import the stage model class of a registered name or a "module:Class" target."""
    entry = stage_model_entry(name)
    return _resolve_target(entry.target, "a class", lambda o: isinstance(o, type))


def resolve_input_processor(name: str) -> Callable[..., Any]:
    """Import the input processor of a registered name or a "module:function" target."""
    return _resolve_target(input_processor_entry(name).target, "callable", callable)


def resolve_incremental_processor(name: str) -> tuple[Callable[..., Any], Callable[[], Any]]:
    """Import the chunk form of an input processor and the factory of its per-request state (ValueError when
    it has no chunk form)."""
    entry = input_processor_entry(name)
    if entry.incremental is None:
        raise ValueError(f"input processor {name!r} has no chunk form: it cannot sit on a streaming edge")
    fn = _resolve_target(entry.incremental, "callable", callable)
    state = dict if entry.chunk_state is None else _resolve_target(entry.chunk_state, "a class",
                                                                     lambda o: isinstance(o, type))
    return fn, state


def resolve_model_path(spec: str | os.PathLike[str], what: str = "model path") -> Path:
    """"scheme:NAME" through its registered resolver; anything else is a local path that must exist.
    `what` names the path in the error ("model path", "tokenizer path")."""
    text = os.fspath(spec)
    scheme, sep, rest = text.partition(":")
    if sep:
        load_plugins()
        if scheme in _PATH_SCHEMES:
            return Path(import_target(_PATH_SCHEMES[scheme])(rest))
    return _existing_path(text, what).resolve()


def check_model_path(spec: str | os.PathLike[str], what: str = "model path") -> None:
    """ValueError when `spec` cannot resolve (a name its scheme does not know, a missing local path);
    builds and loads nothing, so a config can be checked before anything starts."""
    text = os.fspath(spec)
    scheme, sep, rest = text.partition(":")
    if sep:
        load_plugins()
        if scheme in _PATH_SCHEMES:
            if scheme in _PATH_CHECKS:
                import_target(_PATH_CHECKS[scheme])(rest)
            return
    _existing_path(text, what)


def _existing_path(text: str, what: str) -> Path:
    path = Path(os.path.expanduser(os.path.expandvars(text)))
    if not path.exists():
        expanded = f" (expanded to {str(path)!r})" if str(path) != text else ""
        schemes = ", ".join(f"{s}:NAME" for s in sorted(_PATH_SCHEMES)) or "none registered"
        raise ValueError(f"{what} {text!r}{expanded} does not exist; give an existing local directory "
                         f"or file, or a registered scheme ({schemes})")
    return path


def import_target(target: str) -> Any:
    """Import "package.module:attr" (attr may be dotted). Raises ImportError/AttributeError/ValueError."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{target!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _resolve_target(target: str, what: str, ok: Callable[[Any], bool]) -> Any:
    """The object at `target`; ValueError "'pkg.mod:x' does not resolve: ..." / "... which is not <what>"."""
    try:
        obj = import_target(target)
    except Exception as e:  # noqa: BLE001 - any import problem is reported the same way
        raise ValueError(f"{target!r} does not resolve: {type(e).__name__}: {e}") from None
    if not ok(obj):
        raise ValueError(f"{target!r} resolved to {obj!r}, which is not {what}")
    return obj


# ------------------------------------------------------- across processes
def snapshot() -> dict[str, dict[str, Any]]:
    """Every table, to re-create this process's registrations in another one."""
    load_plugins()
    return {"stage_models": dict(_STAGE_MODELS), "input_processors": dict(_INPUT_PROCESSORS),
            "path_schemes": dict(_PATH_SCHEMES), "path_checks": dict(_PATH_CHECKS)}


def restore(snap: dict[str, dict[str, Any]]) -> None:
    load_plugins()
    _STAGE_MODELS.update(snap.get("stage_models", {}))
    _INPUT_PROCESSORS.update(snap.get("input_processors", {}))
    _PATH_SCHEMES.update(snap.get("path_schemes", {}))
    _PATH_CHECKS.update(snap.get("path_checks", {}))
