"""llama-cpp-python 0.3.36 side of bench/generation.py (runs in bench/.venv-llama-cpp-python).

Same method as llamabind's round: pp = random tokens (BOS first) through Llama.eval in n_batch
chunks; tg = one random token at a time from an empty cache through Llama.eval; e2e = a streamed
greedy create_completion of the same prompt. Prints one JSON line of tokens/s."""

import json
import random
import sys
import time

from llama_cpp import Llama

a = json.loads(sys.argv[1])
n_prompt, n_gen = a["n_prompt"], a["n_gen"]
rng = random.Random(a["seed"])


def make(n_ctx):  # as llama-bench: each test in its own context
    return Llama(
        model_path=a["model"],
        n_ctx=n_ctx,
        n_batch=a["n_batch"],
        n_ubatch=a["n_ubatch"],
        n_threads=a["threads"],
        n_threads_batch=a["threads"],
        verbose=False,
        seed=a["seed"],
    )


llm = make(n_prompt)
n_vocab = llm.n_vocab()
bos = llm.token_bos() if llm._model.add_bos_token() else None


def prompt_tokens():
    t = [rng.randrange(n_vocab) for _ in range(n_prompt)]
    if bos is not None:
        t[0] = bos
    return t


llm.eval(prompt_tokens()[: min(n_prompt, a["n_batch"])])  # warm-up
llm.reset()
toks = prompt_tokens()
t0 = time.perf_counter()
llm.eval(toks)
pp = n_prompt / (time.perf_counter() - t0)
llm.close()
llm = make(n_gen)
llm.eval([bos if bos is not None else rng.randrange(n_vocab)])  # warm-up
llm.reset()
tok = bos if bos is not None else rng.randrange(n_vocab)
t0 = time.perf_counter()
for _ in range(n_gen):
    llm.eval([tok])
    tok = rng.randrange(n_vocab)
tg = n_gen / (time.perf_counter() - t0)
llm.close()
llm = make(n_prompt + n_gen)
llm.reset()
t0 = time.perf_counter()
n_tok, text = 0, ""
for chunk in llm.create_completion(a["prompt"], max_tokens=n_gen, temperature=0.0, top_k=1, stream=True):
    n_tok += 1
    text += chunk["choices"][0]["text"]
e2e = n_tok / (time.perf_counter() - t0)
print(json.dumps({"pp": pp, "tg": tg, "e2e": e2e, "e2e_tokens": n_tok, "e2e_chars": len(text)}))
