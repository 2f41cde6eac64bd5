"""One timed llama-cpp-python completion, run by bench/decode.py in a child process: a crash
inside llama.cpp (it has ended whole benchmark runs with a general-protection fault) then ends
only this process, and the parent records it as the contender's result.

Prints one JSON line {"tokens": N, "seconds": S}; exit code 3 when llama_cpp is not installed.
Usage: python bench/llama_cpp_worker.py GGUF PROMPT TOKENS THREADS LOGPROBS"""

from __future__ import annotations

import json
import sys
import time


def main() -> int:
    path, prompt = sys.argv[1], sys.argv[2]
    tokens, threads, logprobs = (int(a) for a in sys.argv[3:6])
    try:
        from llama_cpp import Llama
    except ImportError:
        return 3
    llm = Llama(model_path=path, n_ctx=512, n_threads=threads, logits_all=logprobs > 0, verbose=False)
    extra = {"logprobs": logprobs} if logprobs else {}
    llm.create_completion(prompt, max_tokens=4, temperature=0, **extra)  # warm-up
    start = time.perf_counter()
    out = llm.create_completion(prompt, max_tokens=tokens, temperature=0, **extra)
    seconds = time.perf_counter() - start
    print(json.dumps({"tokens": out["usage"]["completion_tokens"], "seconds": seconds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
