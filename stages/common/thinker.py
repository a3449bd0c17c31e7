"""What the omni thinkers (Qwen2.5-Omni, Qwen3-Omni) share as stages: their decoder's KV geometry, the prompt
pipeline (media items, rendering, placeholder expansion, 3-D rotary positions), the encoder cache in front of
their vision and audio encoders, and the per-request state the forward reads.

A family's thinker sets up its parts in `__init__` (through `OmniThinkerStage.__init__`) and supplies what
differs: how it makes an image or audio item (`mm_item`), an audio track's item (`track_item`) and how it takes
videos (`video_spec`), how it renders a chat prompt (`render_prompt`), when a prompt needs transformers' 3-D
positions (`prompt_positions`), and its forward.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omni.engine.core.request import MultiModalFeature
from omni.engine.memory import StageGeometry, checkpoint_geometry
from omni.engine.stage_model import AutoregressiveStageModel, KVSpec, PreparedPrompt
from omni.errors import RequestError
from omni.messages import MultiModalInput, StageInput

from stages.common.encoder_cache import EncoderCache
from stages.common.decoder import decoder_kv_spec
from stages.common.media import media_names
from stages.common.mm_items import MMItem, expand_placeholders
from stages.common.video_items import VideoSpec, use_audio_in_video, video_item, video_tracks

THINKER_EOS = 151645  # <|im_end|>


@dataclass(slots=True)
class ThinkerRequest:
    """One request's media and positions, kept from `preprocess` to `remove_request`."""

    items: list[MMItem]  # sorted by offset
    positions: torch.Tensor | None  # [3, num_prompt] int64; None: plain positions on the three axes
    delta: int  # generated token at index p has position p + delta (all three axes)


def text_model(thinker):
    """The thinker's decoder: `thinker.model.language_model` since transformers 5.2x, `thinker.model` itself
    before (5.17 still runs on our GPU machines)."""
    return getattr(thinker.model, "language_model", thinker.model)


def audio_tower(thinker):
    tower = getattr(thinker, "audio_tower", None)
    return tower if isinstance(tower, torch.nn.Module) else thinker.model.audio_tower


class OmniThinkerStage(AutoregressiveStageModel):
    def __init__(self, thinker, rope_model, tokenizer, device: torch.device, dtype: torch.dtype,
                 encoder_cache_size: int):
        """`rope_model`: the module whose `get_rope_index` gives the prompt's 3-D positions."""
        self.thinker = thinker
        self.rope_model = rope_model
        self.tokenizer = tokenizer
        self.device, self.dtype = device, dtype
        cfg = thinker.config
        self.text_config = tc = cfg.text_config
        self.lm = text_model(thinker)
        self.embed_tokens = self.lm.embed_tokens
        self.lm_head = thinker.lm_head
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.max_model_len = int(tc.max_position_embeddings)
        eos = getattr(getattr(thinker, "generation_config", None), "eos_token_id", None) or THINKER_EOS
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.image_token_id = cfg.image_token_id
        self.audio_token_id = cfg.audio_token_id
        self.video_token_id = cfg.video_token_id
        self.video_spec: VideoSpec | None = None  # set by a family that takes videos
        self.encoder_cache = EncoderCache(encoder_cache_size)
        self._requests: dict[str, ThinkerRequest] = {}

    @classmethod
    def checkpoint_geometry(cls, model_path: Path) -> StageGeometry | None:
        return checkpoint_geometry(model_path, "thinker_config", "text_config")

    def kv_spec(self) -> KVSpec:
        return decoder_kv_spec(self.text_config)

    # ------------------------------------------------------------ per request
    def mm_item(self, inp: MultiModalInput, where: str) -> MMItem:
        """An image or audio input, checked and preprocessed."""
        raise NotImplementedError

    def track_item(self, inp: MultiModalInput, where: str) -> MMItem:
        """A video's audio track (mono at the encoder's rate) as its audio MMItem."""
        return self.mm_item(inp, where)

    def media_items(self, inp: StageInput, names: list[str]) -> list[MMItem]:
        """The prompt's media, checked and preprocessed (`names`: how the API names each one). With
        use_audio_in_video a video's item carries its audio track (given as the prompt's audio inputs, or decoded
        from the file)."""
        with_audio = use_audio_in_video(inp)
        inputs, tracks = video_tracks(inp, with_audio)
        if len(inputs) != len(inp.mm_inputs):  # the audio inputs are the videos' tracks
            names = [n for m, n in zip(inp.mm_inputs, names) if m.modality != "audio"]
        tracks_left = iter(tracks)
        items = []
        for m, where in zip(inputs, names):
            if m.modality != "video":
                items.append(self.mm_item(m, where))
                continue
            if self.video_spec is None:
                raise RequestError(f"{where}: this thinker takes no video", field=where)
            items.append(video_item(m, self.video_spec, where, self.max_model_len, with_audio=with_audio,
                                    track=next(tracks_left), audio_item=self.track_item))
        return items

    def render_prompt(self, inp: StageInput, items: list[MMItem]) -> str:
        """The text of a `prompt` (text or chat messages) with one placeholder per media item."""
        raise NotImplementedError

    def prompt_positions(self, ids: list[int], items: list[MMItem]) -> tuple[torch.Tensor | None, int]:
        """The prompt's 3-D rotary positions and delta (None: plain positions)."""
        return self.rope_index(ids, items)

    def preprocess(self, inp: StageInput) -> PreparedPrompt:
        items = self.media_items(inp, media_names(inp.mm_inputs))
        if inp.prompt_token_ids is not None:
            ids = [int(t) for t in inp.prompt_token_ids]
        elif inp.prompt is not None:
            ids = list(self.tokenizer(self.render_prompt(inp, items))["input_ids"])
        else:
            raise RequestError("prompt: the thinker needs `prompt` (text or chat messages) or `prompt_token_ids`",
                               field="prompt")
        ids = expand_placeholders(ids, items, {"image": self.image_token_id, "audio": self.audio_token_id,
                                               "video": self.video_token_id})
        positions, delta = self.prompt_positions(ids, items)
        items = sorted(items, key=lambda it: it.offset)
        feats = [MultiModalFeature(it.mm_hash, it.offset, it.num_tokens, it.modality) for it in items]
        return PreparedPrompt(ids, feats, None, {"thinker": ThinkerRequest(items, positions, delta)})

    def rope_index(self, ids: list[int], items: list[MMItem]) -> tuple[torch.Tensor, int]:
        """transformers' own 3-D rotary positions of one prompt: ([3, L] int64, delta). Each modality's grids
        and audio lengths in prompt order (a video's track where its video is), as its get_rope_index reads them."""
        x = torch.tensor([ids], dtype=torch.long)
        items = sorted(items, key=lambda it: it.offset)
        grids = [it.grid_thw for it in items if it.modality == "image"]
        videos = [it for it in items if it.modality == "video"]
        audio_lens = [a.frames for it in items for a in ([it] if it.modality == "audio" else [it.audio])
                      if a is not None]
        with_audio = any(v.audio is not None for v in videos)
        pos, delta = self.rope_model.get_rope_index(
            x, torch.stack(grids) if grids else None, torch.stack([v.grid_thw for v in videos]) if videos else None,
            torch.ones_like(x), with_audio, torch.tensor(audio_lens, dtype=torch.long) if audio_lens else None,
            torch.tensor([v.second_per_grid for v in videos]) if videos else None)
        return pos[:, 0].long().cpu(), int(delta.reshape(-1)[0])

    def add_request(self, request_id: str, prompt: PreparedPrompt | None, inp: StageInput) -> None:
        st = prompt.extra["thinker"] if prompt is not None else None
        if st is not None and (st.items or st.positions is not None):  # else: nothing the forward needs
            self._requests[request_id] = st

    def remove_request(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ---------------------------------------------------------------- encoders
    def encode(self, item: MMItem) -> tuple[torch.Tensor, list[torch.Tensor] | None, torch.Tensor | None]:
        """Encoder rows [num_tokens, hidden] of one input, + the visual rows' deepstack rows (one tensor per
        deepstack layer, where the vision tower makes them) and which of the item's rows are visual (None: all, or
        none without deepstack rows), through the encoder cache. A video with its audio track: the vision tower's
        and the audio tower's rows interleaved as its placeholders are."""
        hit = self.encoder_cache.get(item.mm_hash)
        if hit is not None:
            return hit
        deep, visual = None, None
        if item.modality == "audio":
            rows = self._audio_rows(item)
        else:  # get_*_features live on the thinker in every transformers 5.x
            get = self.thinker.get_image_features if item.modality == "image" else self.thinker.get_video_features
            out = get(item.data.to(self.device), item.grid_thw[None].to(self.device), return_dict=True)
            rows = out.pooler_output[0].to(self.dtype)
            if getattr(out, "deepstack_features", None) is not None:
                deep = [f[0].to(self.dtype) for f in out.deepstack_features]
            if item.audio is not None:
                run = item.ids[item.lead : item.lead + item.num_tokens]
                visual = torch.tensor([t == self.video_token_id for t in run])
                audio = self._audio_rows(item.audio)
                mixed = rows.new_empty((item.num_tokens, rows.shape[1]))
                if int(visual.sum()) != rows.shape[0] or int((~visual).sum()) != audio.shape[0]:
                    raise ValueError(f"video encoders produced {rows.shape[0]} + {audio.shape[0]} rows for "
                                     f"{int(visual.sum())} + {int((~visual).sum())} placeholders")
                mixed[visual.to(rows.device)] = rows
                mixed[~visual.to(rows.device)] = audio
                rows = mixed
        if rows.shape[0] != item.num_tokens:
            raise ValueError(f"{item.modality} encoder produced {rows.shape[0]} rows for {item.num_tokens} "
                             "placeholders")
        self.encoder_cache.put(item.mm_hash, (rows, deep, visual))
        return rows, deep, visual

    def _audio_rows(self, item: MMItem) -> torch.Tensor:
        feats = item.data.to(self.device, audio_tower(self.thinker).dtype)[None]
        mask = torch.ones(1, feats.shape[-1], dtype=torch.long, device=self.device)
        out = self.thinker.get_audio_features(feats, feature_attention_mask=mask, return_dict=True)
        return out.last_hidden_state.to(self.dtype)

    # ---------------------------------------------------------------- forward
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states).float()

    def stats(self) -> dict[str, int]:
        return self.encoder_cache.stats()
