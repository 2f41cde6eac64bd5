"""vLLM as an engine of lmtrace: `vllm.LLM` decodes, lmtrace turns each RequestOutput into the
same Trace its own engine writes (lmtrace.vllm.convert) and checks vLLM's numbers against a
teacher-forced rescoring of the same tokens.

    lm = lmtrace.load("model-folder")
    engine = VLLMEngine(lm, "model-folder")            # or VLLMEngine.start(lm, source)
    traces = engine.generate(["Hello", "很久很久以前，"], temperature=0, max_new_tokens=16)

vLLM is imported only here, when an engine starts; it runs in this process (no engine-core
subprocess), which keeps start-up simple for scripts and tests."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmtrace.errors import GenerationError, InvalidParameter
from lmtrace.model.lm import LM
from lmtrace.params import MAX_TOP_LOGPROBS, SamplingParams
from lmtrace.records import Trace
from lmtrace.vllm import kv
from lmtrace.vllm.convert import PROCESSED, RAW, Request, provenance, to_trace
from lmtrace.vllm.params import to_vllm
from lmtrace.vllm.rescore import rescore_many

MODES = {"raw": RAW, "processed": PROCESSED, RAW: RAW, PROCESSED: PROCESSED}
# the CPU build reserves this much memory for the paged cache unless told otherwise (vLLM's own
# default there is a fraction of the whole machine's memory)
CPU_KV_CACHE_BYTES = 1 << 30
CPU_HEAD_DIMS = (32, 512)
# every engine started in this process, kept until it ends: vLLM's engines in one process share
# its global parallel state, and the finalizer of any one of them tears that down for all
_LIVE: list[Any] = []


def _missing(reason: str) -> InvalidParameter:
    return InvalidParameter(f"engine: --engine vllm needs vLLM ({reason}); install it: see the README, 'lmtrace[vllm]'")


def check_vllm() -> None:
    """Says that vLLM is missing without importing it (an import takes ~20 s on a CPU)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken or hidden module
        found = False
    if not found:
        raise _missing("No module named 'vllm'")


def import_vllm() -> Any:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its start-up advice is not ours to print
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        import vllm
    except ImportError as e:
        raise _missing(f"{type(e).__name__}: {e}") from e
    return vllm


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"


def _check_cpu_head_dim(lm: LM, folder: str) -> None:
    """vLLM's CPU attention kernels take head sizes 32 to 512: said before the engine starts."""
    head_dim = lm.summary.head_dim
    if head_dim and not CPU_HEAD_DIMS[0] <= head_dim <= CPU_HEAD_DIMS[1]:
        raise InvalidParameter(
            f"model: vLLM cannot run {folder!r} on the CPU: its attention takes head_dim "
            f"{CPU_HEAD_DIMS[0]} to {CPU_HEAD_DIMS[1]}, this model has {head_dim}"
        )


class VLLMEngine:
    """One vllm.LLM over a model folder, and the lmtrace LM of the same weights (its tokenizer
    encodes the prompts and decodes the text; its model rescores)."""

    def __init__(
        self,
        lm: LM,
        folder: str | Path,
        *,
        logprobs_mode: str = "raw",
        tensor_parallel_size: int = 1,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        **engine_kwargs: Any,
    ):
        if logprobs_mode not in MODES:
            raise InvalidParameter(f"logprobs_mode must be raw or processed, got {logprobs_mode!r}")
        if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
            raise InvalidParameter(f"tensor_parallel_size must be an integer >= 1, got {tensor_parallel_size!r}")
        vllm = import_vllm()
        from vllm.platforms import current_platform

        cpu = current_platform.is_cpu()
        self.lm, self.folder, self.mode = lm, str(folder), MODES[logprobs_mode]
        context = getattr(lm.model.config, "max_position_embeddings", None)
        self.max_model_len = max_model_len or context
        dtype = lm.summary.dtype or "float32"
        kwargs: dict[str, Any] = {
            "model": self.folder,
            "dtype": dtype,  # the rescoring model's: both run the same weights in the same precision
            "tensor_parallel_size": tensor_parallel_size,
            "max_model_len": self.max_model_len,
            "logprobs_mode": self.mode,
            "max_logprobs": MAX_TOP_LOGPROBS,
            "enforce_eager": cpu,  # on a CPU no compiling (it needs Triton's CPU backend); GPUs keep CUDA graphs
            "seed": 0,
            "disable_log_stats": False,  # per-request timings (RequestOutput.metrics)
            **engine_kwargs,
        }
        if kv_cache_bytes is not None or cpu:
            kwargs["kv_cache_memory_bytes"] = kv_cache_bytes or CPU_KV_CACHE_BYTES
        if cpu:
            _check_cpu_head_dim(lm, self.folder)
        import torch

        set_num_threads, threads = torch.set_num_threads, torch.get_num_threads()
        try:
            self.llm = vllm.LLM(**kwargs)
        except (ValueError, TypeError, NotImplementedError, KeyError, OSError) as e:
            raise InvalidParameter(f"model: vLLM cannot run {self.folder!r} ({_one_line(e)})") from e
        except Exception as e:
            if "unsupported" in str(e).lower() or "not supported" in str(e).lower():
                raise InvalidParameter(f"model: vLLM cannot run {self.folder!r} ({_one_line(e)})") from e
            raise GenerationError(f"vLLM failed to start on {self.folder!r} ({_one_line(e)})") from e
        finally:
            # vLLM's CPU worker, running in this process, binds its threads and replaces
            # torch.set_num_threads with a no-op: the caller's setting is put back
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        _LIVE.append(self.llm)
        device = "cpu" if cpu else current_platform.device_type
        self.provenance = provenance(self.mode, vllm.__version__)
        self.kv = kv.layout(self.llm.llm_engine.vllm_config, lm.model.config, dtype, device)

    @classmethod
    def start(cls, lm: LM, source: str | None, **kwargs: Any) -> VLLMEngine:
        """An engine on `source` (a folder as it is; else lmtrace's export of `lm` in the cache)."""
        from lmtrace.vllm.folder import model_folder

        return cls(lm, model_folder(lm, source), **kwargs)

    def trace(self, requests: Sequence[Request]) -> list[Trace | str]:
        """One Trace per request, decoded together (vLLM batches them continuously), or the
        one-line reason a request could not be done."""
        eos = self.lm.eos_token_ids
        results: list[Trace | str | None] = [None] * len(requests)
        todo, sampling = [], []
        for i, r in enumerate(requests):
            try:
                sampling.append(to_vllm(r.params, eos, r.echo))
                todo.append(i)
            except (ValueError, TypeError) as e:
                results[i] = f"vLLM refuses the settings ({_one_line(e)})"
        if todo:
            self._decode([requests[i] for i in todo], sampling, todo, results)
        return results  # type: ignore[return-value]

    def _decode(self, requests: list[Request], sampling: list[Any], where: list[int], results: list) -> None:
        """Decodes the requests together; when vLLM refuses the batch, each alone, so that one
        request's error is that request's only."""
        prompts = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        started = time.perf_counter()
        try:
            outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        except (ValueError, TypeError) as e:
            if len(requests) == 1:
                results[where[0]] = f"vLLM refuses the request ({_one_line(e)})"
                return
            for r, s, i in zip(requests, sampling, where):
                self._decode([r], [s], [i], results)
            return
        wall_ms = (time.perf_counter() - started) * 1000
        items = [(r.prompt_ids, list(out.outputs[0].token_ids), r.params, r.echo) for r, out in zip(requests, outputs)]
        rescored = rescore_many(self.lm, items)  # one forward pass for many rows
        for r, out, i, res in zip(requests, outputs, where, rescored):
            try:
                results[i] = to_trace(self.lm, r, out, self.provenance, self.kv, wall_ms, res)
            except ValueError as e:  # vLLM gave back what a trace cannot hold (an aborted request)
                results[i] = f"cannot trace vLLM's output ({_one_line(e)})"

    def generate(
        self, prompts: str | Sequence[str], params: SamplingParams | None = None, *, chat: bool = False,
        echo: bool = False, **kwargs: Any,
    ) -> Trace | list[Trace]:  # fmt: skip
        """Like lmtrace.generate, decoded by vLLM: a Trace per prompt (one for a string)."""
        from lmtrace.decode.tracing import make_params

        texts = [prompts] if isinstance(prompts, str) else list(prompts)
        traces = self.generate_each(texts, [make_params(params, **kwargs)] * len(texts), chat=chat, echo=echo)
        return traces[0] if isinstance(prompts, str) else traces

    def generate_each(
        self, prompts: Sequence[str], params: Sequence[SamplingParams], *, chat: bool = False, echo: bool = False
    ) -> list[Trace]:
        """A Trace per prompt, each with its own params, decoded together; a sampled prompt
        without a seed gets a random one (recorded in its trace)."""
        from lmtrace.decode.tracing import encode_prompt, make_params

        requests = []
        for text, p in zip(prompts, params, strict=True):
            if not p.greedy and p.seed is None:
                p = make_params(p, seed=random.randrange(2**31))
            requests.append(Request(text, encode_prompt(self.lm, text, chat), p, chat, echo))
        traces = self.trace(requests)
        for t in traces:
            if isinstance(t, str):
                raise InvalidParameter(t)
        return traces  # type: ignore[return-value]
