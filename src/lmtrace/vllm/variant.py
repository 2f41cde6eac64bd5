"""`engine:vllm`, a variant of the stability ledger (lmtrace.stability): the same weights run by
vLLM. Teacher forcing is vLLM's own `prompt_logprobs` over prompt + the reference's tokens (raw
mode); decoding is vLLM's (greedy; with sampling its sampler draws from the same seed its own
way, so that a divergence there also says the samplers differ).

The ledger's family sits below this one: the package's __init__ registers `world` for it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from lmtrace.errors import InvalidParameter
from lmtrace.model.lm import LM
from lmtrace.params import SamplingParams
from lmtrace.scoring.variants.spec import VariantSpec
from lmtrace.scoring.variants.worlds import World

# alternatives asked of vLLM per forced position: the reference's runner-up is among them
# unless the variant moved it below this rank (its margin change is then unknown, null)
FORCED_TOP = 20


def _source(lm: LM) -> str | None:
    """What VLLMEngine.start exports or uses: the bundled model (None), a file or a folder."""
    if lm.source.startswith("bundled:"):
        return None
    if Path(lm.source).expanduser().exists():
        return lm.source
    raise InvalidParameter(f"engine:vllm loads the model from its file or folder; {lm.source!r} is neither")


class VLLMWorld(World):
    """The reference's weights in a vLLM engine (float32 on a CPU, as the reference)."""

    def __init__(self, lm: LM, spec: VariantSpec):
        from lmtrace.vllm.engine import VLLMEngine, check_vllm

        check_vllm()
        super().__init__(lm, spec)
        self.engine = VLLMEngine.start(lm, _source(lm), logprobs_mode="raw")
        self.about = f"vLLM {self.engine.provenance['version']} on {self.engine.kv.device} (raw logprobs)"

    def forced(self, ids: Sequence[int], first: int) -> torch.Tensor:
        """(len(ids) - first, vocab) log-probs: vLLM's top FORCED_TOP and the forced token at each
        position, -inf elsewhere (vLLM reports no more)."""
        from lmtrace.vllm.convert import Request

        params = SamplingParams(max_new_tokens=1, temperature=0.0, top_logprobs=FORCED_TOP, stop_on_eos=False)
        text = self.lm.tokenizer.decode(list(ids))
        trace = self.engine.trace([Request(text, list(ids), params, echo=True)])[0]
        if isinstance(trace, str):
            raise InvalidParameter(f"{self.spec.spec}: {trace}")
        vocab = self.lm.model.config.get_text_config().vocab_size
        out = torch.full((len(ids) - first, vocab), float("-inf"))
        for j, score in enumerate(trace.prompt_logprobs[first:]):
            for c in score.top:
                out[j, c.token_id] = c.logprob
            out[j, score.token_id] = score.logprob
        return out

    def decode(self, prompt: str, ids: list[int], params: SamplingParams, chat: bool = False) -> list[int]:
        from lmtrace.vllm.convert import Request

        trace = self.engine.trace([Request(prompt, list(ids), params, chat)])[0]
        if isinstance(trace, str):
            raise InvalidParameter(f"{self.spec.spec}: {trace}")
        return list(trace.token_ids)


def world(lm: LM, spec: VariantSpec) -> World:
    """The World of `engine:vllm` (InvalidParameter where vLLM is not installed or refuses)."""
    return VLLMWorld(lm, spec)
