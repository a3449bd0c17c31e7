"""StageGraph: the validated DAG of stages.

    thinker ──> talker ──> code2wav          (a chain)

    drafter ─┬─> critic_a ─┐
             └─> critic_b ─┴─> judge        (fan-out, then fan-in)

An edge u -> v exists when v lists u in its `inputs`. Stages with no inputs
are entry stages (they receive the user's prompt); stages with a
`final_output` return their outputs to the caller. A stage with several
inputs runs once all of them finished the request and receives all their
outputs.

Per-token rows (hidden states and the other per-token outputs) leave a stage for
every request only where someone reads them: its final output is "hidden", or an
edge's input processor reads them (hidden_to_embeds, thinker2talker). A leaf
stage hands them out only to callers who ask (return_hidden_states).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from omni import registry
from omni.errors import ConfigError, RequestError

if TYPE_CHECKING:
    from omni.config.schema import InputEdge, PipelineConfig, StageConfig


def _edge_name(edge: "str | InputEdge") -> str:
    return edge if isinstance(edge, str) else edge.stage


class StageGraph:
    """Validated DAG over stage configs. Raises ConfigError naming the offending stage."""

    @classmethod
    def of(cls, config: "PipelineConfig") -> "StageGraph":
        """The graph of `config`: built once (load_config builds it) and kept with the config, so that the
        API, the CLI and the backends share one. Built here for a config made otherwise (PipelineConfig(...))
        or whose stages were replaced since."""
        graph = config._graph
        if not isinstance(graph, cls) or not graph._built_from(config.stages):
            graph = config._graph = cls(config.stages)
        return graph

    def _built_from(self, stages: Sequence["StageConfig"]) -> bool:
        return len(stages) == len(self.stages) and all(self.stages.get(s.name) is s for s in stages)

    def __init__(self, stages: Sequence["StageConfig"]):
        if not stages:
            raise ConfigError("stages: at least one stage is required")
        names = [s.name for s in stages]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ConfigError(f"stages: stage names must be unique; duplicated: {', '.join(map(repr, dupes))}")
        self.stages: dict[str, StageConfig] = {s.name: s for s in stages}

        for s in stages:
            seen: set[str] = set()
            for up in map(_edge_name, s.inputs):
                if up == s.name:
                    raise ConfigError(f"stage {s.name!r}: inputs: a stage cannot be its own input")
                if up not in self.stages:
                    raise ConfigError(
                        f"stage {s.name!r}: inputs: unknown stage {up!r} (stages: {', '.join(names)})")
                if up in seen:
                    raise ConfigError(f"stage {s.name!r}: inputs: {up!r} is listed twice")
                seen.add(up)

        self.upstream: dict[str, list[str]] = {s.name: [_edge_name(e) for e in s.inputs] for s in stages}
        self.downstream: dict[str, list[str]] = {n: [] for n in names}
        # (upstream, downstream) -> edge, for the streaming ones: the downstream stage starts
        # with the upstream and its prompt grows chunk by chunk.
        self.streaming_edges: dict[tuple[str, str], "InputEdge"] = {}
        for s in stages:
            for edge in s.inputs:
                self.downstream[_edge_name(edge)].append(s.name)
                if getattr(edge, "stream", False):
                    self.streaming_edges[(edge.stage, s.name)] = edge

        self.entry_stages = [n for n in names if not self.upstream[n]]
        self._check_acyclic(names)  # first: a graph whose every stage has inputs usually holds a cycle, named
        if not self.entry_stages:
            raise ConfigError(
                "stages: no entry stage: every stage has inputs; at least one stage must have "
                "no `inputs` (it receives the prompt)")
        self.order = self._topological_order(names)

        self.final_stages = [n for n in self.order if self.stages[n].final_output is not None]
        if not self.final_stages:
            raise ConfigError(
                "stages: no final output: set `final_output` (text | tokens | audio | hidden) "
                "on at least one stage")
        for n in self.order:
            if not self.downstream[n] and self.stages[n].final_output is None:
                raise ConfigError(
                    f"stage {n!r}: final_output: the stage feeds no other stage and has no "
                    "final_output, so its outputs would be discarded; set final_output or remove it")
        for n in self.order:
            self._check_rows_exist(n)
        for (up, down) in self.streaming_edges:
            model = self.stages[up].model
            if not registry.stage_model_entry(model).info.autoregressive:
                raise ConfigError(f"stage {down!r}: inputs[0].stream: stage {up!r} ({model!r}) is a one-shot "
                                  "stage and produces its output at once: there is nothing to stream")

    def _processor(self, name: str) -> registry.InputProcessorEntry:
        return registry.input_processor_entry(self.stages[name].input_processor or "passthrough_tokens")

    def _check_rows_exist(self, name: str) -> None:
        if not self.upstream[name] or not self._processor(name).needs_hidden_states:
            return
        for up in self.upstream[name]:
            model = self.stages[up].model
            if not registry.stage_model_entry(model).info.emits_hidden_states:
                raise ConfigError(
                    f"stage {name!r}: input_processor: {self.stages[name].input_processor!r} reads the hidden "
                    f"states of stage {up!r}, whose model {model!r} emits none")

    def _check_acyclic(self, names: list[str]) -> None:
        WHITE, GREY, BLACK = 0, 1, 2
        color = {n: WHITE for n in names}
        path: list[str] = []

        def visit(n: str) -> None:
            color[n] = GREY
            path.append(n)
            for d in self.downstream[n]:
                if color[d] == GREY:
                    cycle = path[path.index(d):] + [d]
                    raise ConfigError(f"stages: the stage graph has a cycle: {' -> '.join(cycle)}")
                if color[d] == WHITE:
                    visit(d)
            path.pop()
            color[n] = BLACK

        for n in names:  # config order: the reported cycle is stable
            if color[n] == WHITE:
                visit(n)

    def _topological_order(self, names: list[str]) -> list[str]:
        # Kahn's algorithm, ties broken by config order (deterministic).
        indeg = {n: len(self.upstream[n]) for n in names}
        ready = [n for n in names if indeg[n] == 0]
        order: list[str] = []
        while ready:
            n = ready.pop(0)
            order.append(n)
            for d in self.downstream[n]:
                indeg[d] -= 1
                if indeg[d] == 0:
                    ready.append(d)
                    ready.sort(key=names.index)
        return order

    # ------------------------------------------------------------- queries
    def __contains__(self, name: str) -> bool:
        return name in self.stages

    def __len__(self) -> int:
        return len(self.stages)

    def streams_to(self, name: str) -> list[tuple[str, "InputEdge"]]:
        """The stages fed by `name` over streaming edges, with their edges."""
        return [(d, self.streaming_edges[(name, d)]) for d in self.downstream[name] if (name, d) in self.streaming_edges]

    def streams_from(self, name: str) -> str | None:
        """The upstream stage of `name`'s streaming input (a stage has at most one), or None."""
        ups = self.upstream[name]
        return ups[0] if ups and (ups[0], name) in self.streaming_edges else None

    def needs_rows(self, name: str) -> bool:
        """Whether stage `name`'s input processor reads its upstream's per-token rows."""
        return self._processor(name).needs_hidden_states is not False

    def is_final(self, name: str) -> bool:
        return self.stages[name].final_output is not None

    def stages_for(self, output_modalities: Iterable[str] | None) -> frozenset[str]:
        """The stages a request runs to produce the final outputs of `output_modalities` (text | tokens | audio
        | hidden, or a final stage's own name; None: every final output): the final stages that give one of them
        (or are named) and everything upstream of those. A text-only reply of a thinker -> talker -> vocoder
        pipeline runs the thinker alone; ["asr"] on asr -> llm -> tts runs the recognizer alone (a transcription,
        where "text" would run the LLM too). RequestError (field output_modalities) for anything else."""
        if output_modalities is None:
            return frozenset(self.order)
        if isinstance(output_modalities, str):
            output_modalities = [output_modalities]
        if not isinstance(output_modalities, Iterable) or not all(isinstance(m, str) for m in output_modalities):
            raise RequestError(f"output_modalities: expected a list of output names (text, tokens, audio, hidden), "
                               f"got {output_modalities!r}", field="output_modalities", code="invalid_type")
        wanted = list(dict.fromkeys(output_modalities))
        given = sorted({self.stages[n].final_output for n in self.final_stages})
        unknown = [m for m in wanted if m not in given and m not in self.final_stages]
        if not wanted or unknown:
            what = f"{unknown[0]!r} is not an output of this pipeline" if unknown else "empty"
            raise RequestError(f"output_modalities: {what}; its final stages give {', '.join(given)} (or name one "
                               f"of them: {', '.join(self.final_stages)})", field="output_modalities",
                               code="unsupported_value")
        need, todo = set(), [n for n in self.final_stages if self.stages[n].final_output in wanted or n in wanted]
        while todo:
            n = todo.pop()
            if n not in need:
                need.add(n)
                todo.extend(self.upstream[n])
        return frozenset(need)

    def emits_hidden_states(self, name: str) -> bool:
        """Whether stage `name` hands every request's per-token rows out (see the module docstring)."""
        return self.stages[name].final_output == "hidden" or any(
            self._processor(d).needs_hidden_states is not False for d in self.downstream[name])

    def summary(self) -> str:
        """Human-readable description, one line per stage in topological order."""
        lines = []
        for n in self.order:
            s = self.stages[n]
            src = ", ".join(u + (" (streaming)" if (u, n) in self.streaming_edges else "")
                            for u in self.upstream[n]) if self.upstream[n] else "<prompt>"
            proc = f" via {s.input_processor or 'passthrough_tokens'}" if self.upstream[n] else ""
            final = f"  final_output={s.final_output}" if s.final_output else ""
            reps = f"  replicas={s.replicas} ({s.routing_policy})" if s.replicas > 1 else ""
            lines.append(
                f"  {n}: {s.model} ({s.model_path})  <- {src}{proc}  "
                f"prefix_caching={'on' if s.enable_prefix_caching else 'off'}{final}{reps}")
        return "\n".join(lines)
