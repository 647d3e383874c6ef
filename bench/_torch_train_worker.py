"""bench/train.py's PyTorch runner (run by PYTHON with torch + transformers, + peft for LoRA, + bitsandbytes for NF4):
one process, one row. ``python _torch_train_worker.py JOB.json`` prints the row as one JSON line.

The job (bench/train.py writes it): model (an F32 GGUF), init ("gguf": transformers loads that file in float32;
"random": the GGUF's shape from its metadata, transformers' own init drawn on the device layer by layer: what an
8B/70B shape needs, whose F32 GGUF would not fit the disk), weights ("f32"; "bf16": what a user who loads with
torch_dtype=bfloat16 holds; or "nf4": every decoder layer's linear layers as bitsandbytes
Linear4bit, NF4 with double quantization, bf16 compute: the QLoRA paper's setting, as BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16)
loads it; the embeddings, norms and lm_head stay bf16), precision (f32, tf32, bf16: autocast), lora (peft LoRA of
rank ``rank``, alpha 2 x rank, dropout 0, on ``targets``), gc (transformers' gradient checkpointing), windows,
n_train, batch, steps, lr, threads, device.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def gguf_shape(path: str) -> dict:
    """LlamaConfig's shape fields from a llama GGUF's metadata."""
    import gguf

    r = gguf.GGUFReader(path)

    def kv(key: str):
        return r.fields[f"llama.{key}"].contents()

    n_vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    tied = not any(t.name == "output.weight" for t in r.tensors)
    return dict(
        vocab_size=n_vocab, hidden_size=kv("embedding_length"), intermediate_size=kv("feed_forward_length"),
        num_hidden_layers=kv("block_count"), num_attention_heads=kv("attention.head_count"),
        num_key_value_heads=kv("attention.head_count_kv"), rms_norm_eps=kv("attention.layer_norm_rms_epsilon"),
        rope_theta=kv("rope.freq_base"), tie_word_embeddings=tied,
    )  # fmt: skip


def to_nf4(layer: torch.nn.Module, dev: torch.device) -> None:
    """Replaces a decoder layer's linear layers by bitsandbytes Linear4bit (NF4, double quantization, bf16 compute),
    quantized from their weights on ``dev``."""
    import bitsandbytes as bnb

    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, torch.nn.Linear):
                continue
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=False, compute_dtype=torch.bfloat16,
                                  compress_statistics=True, quant_type="nf4", device="meta")  # fmt: skip
            q.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                         quant_type="nf4", module=q).to(dev)  # fmt: skip
            setattr(parent, name, q)


def random_model(path: str, ctx: int, dev: torch.device, dtype: torch.dtype, nf4: bool) -> torch.nn.Module:
    """The GGUF's shape with transformers' own random init in ``dtype``, built on ``dev`` one decoder layer at a time
    (a 70B's layers quantized as they come: its bf16 weights never all exist at once)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = gguf_shape(path)
    c = LlamaConfig(**shape, max_position_embeddings=max(8192, ctx), attn_implementation="sdpa")
    torch.set_default_dtype(dtype)
    with torch.device("meta"):
        m = LlamaForCausalLM(c)
    for i, layer in enumerate(m.model.layers):
        with torch.device(dev):
            new = type(layer)(c, i)
        if nf4:
            to_nf4(new, dev)
        m.model.layers[i] = new
    with torch.device(dev):
        m.model.embed_tokens = torch.nn.Embedding(c.vocab_size, c.hidden_size)
        m.model.norm = type(m.model.norm)(c.hidden_size, eps=c.rms_norm_eps)
        m.model.rotary_emb = type(m.model.rotary_emb)(config=c)
        m.lm_head = torch.nn.Linear(c.hidden_size, c.vocab_size, bias=False)
    if shape["tie_word_embeddings"]:
        m.lm_head.weight = m.model.embed_tokens.weight
    torch.set_default_dtype(torch.float32)
    return m


def load(cfg: dict, dev: torch.device) -> torch.nn.Module:
    nf4 = cfg.get("weights") == "nf4"
    if cfg.get("init") == "random":
        dtype = torch.float32 if cfg.get("weights", "f32") == "f32" else torch.bfloat16
        m = random_model(cfg["model"], len(cfg["windows"][0]), dev, dtype, nf4)
    else:
        from transformers import AutoModelForCausalLM

        p = Path(cfg["model"])
        m = AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32)
        if nf4 or cfg.get("weights") == "bf16":
            m = m.to(torch.bfloat16)
        if nf4:
            for layer in m.model.layers:
                to_nf4(layer.to(dev), dev)
        m = m.to(dev)
    m.train()
    if cfg.get("gc"):  # each decoder layer's activations recomputed in the backward pass
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg["lora"]:
        from peft import LoraConfig, get_peft_model

        targets = cfg.get("targets") or ["q_proj", "v_proj"]
        m = get_peft_model(
            m, LoraConfig(r=cfg["rank"], lora_alpha=2 * cfg["rank"], lora_dropout=0.0, target_modules=targets)
        )
    return m


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    torch.set_num_threads(cfg["threads"])
    dev = torch.device(cfg["device"])
    prec = cfg["precision"]
    torch.backends.cuda.matmul.allow_tf32 = prec == "tf32"
    torch.backends.cudnn.allow_tf32 = prec == "tf32"
    t0 = time.perf_counter()
    m = load(cfg, dev)
    load_s = time.perf_counter() - t0
    opt = torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=cfg["lr"], weight_decay=0.0)
    wins = torch.tensor(cfg["windows"], device=dev)
    B, n_train, steps = cfg["batch"], cfg["n_train"], cfg["steps"]
    times, losses = [], []
    for s in range(steps):
        w = wins[[(s * B + j) % n_train for j in range(B)]]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=prec == "bf16"):
            logits = m(w[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1))
        del logits
        loss.backward()
        opt.step()
        losses.append(loss.item())  # synchronizes
        times.append(time.perf_counter())
    val = []
    with torch.no_grad(), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=prec == "bf16"):
        for w in wins[n_train:][: cfg.get("max_val", 1 << 30)]:
            val.append(F.cross_entropy(m(w[None, :-1]).logits[0].float(), w[1:]).item())
    T = wins.shape[1] - 1
    tps = (len(times) - 1) * B * T / (times[-1] - times[0]) if len(times) > 1 else float("nan")
    row = dict(
        steps=steps, batch=B, train_tok_s=tps, train_loss=sum(losses) / len(losses),
        val_loss=sum(val) / max(1, len(val)), step_times=[round(b - a, 5) for a, b in zip(times, times[1:])],
        load_s=round(load_s, 2),
        peak_alloc_mb=torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )  # fmt: skip
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
