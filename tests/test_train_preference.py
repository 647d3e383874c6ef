"""Issue 58: preference pairs read from TRL's formats (llamabind.train.read_pairs), the log-probabilities of their
answers (pair_logps), DPO's / ORPO's losses and reward metrics (preference_metrics), and training on them
(train.preference, patch 0054's loss in the training graph), against PyTorch (transformers on the same F32 GGUF;
the losses as TRL states them)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from conftest import reference_job

import llamabind
from llamabind import train

ROWS = [
    {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " a large banana."},
    {"prompt": [{"role": "user", "content": "What is 2+2?"}], "chosen": [{"role": "assistant", "content": "4"}],
     "rejected": [{"role": "assistant", "content": "It is 5, I think."}]},
    {"chosen": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi!"}],
     "rejected": [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "No."}]},
]  # fmt: skip


def test_read_pairs_in_trls_formats(model_path, tmp_path):
    """A JSONL file of the three formats: text (the prompt with the vocabulary's BOS where it adds one, each
    answer tokenized on its own then EOS), conversational with an explicit prompt, and with the prompt implicit
    (the messages both conversations share): the prompt and an answer together are the chat template's
    rendering of the conversation with that answer, the prompt its rendering through the generation prompt."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    with llamabind.Model(model_path, vocab_only=True) as m:
        pairs = train.read_pairs(path, m)
        assert len(pairs) == 3
        text = pairs[0]
        assert text.prompt.tolist() == m.tokenize(ROWS[0]["prompt"], add_special=True)
        assert text.chosen.tolist() == m.tokenize(" Paris.", add_special=False) + [m.token_eos]
        tpl = m.chat_templates()
        for p, (prompt, chosen, rejected) in zip(pairs[1:], [
            (ROWS[1]["prompt"], ROWS[1]["chosen"], ROWS[1]["rejected"]),
            (ROWS[2]["chosen"][:1], ROWS[2]["chosen"][1:], ROWS[2]["rejected"][1:]),
        ]):  # fmt: skip
            assert m.detokenize(p.prompt.tolist(), unparse_special=True) == tpl.render(
                prompt, add_generation_prompt=True
            )
            for answer, toks in ((chosen, p.chosen), (rejected, p.rejected)):
                whole = m.detokenize(np.concatenate([p.prompt, toks]).tolist(), unparse_special=True)
                assert whole == tpl.render(prompt + answer, add_generation_prompt=False)
        assert [len(p.chosen) for p in train.read_pairs(ROWS, m)] == [len(p.chosen) for p in pairs]  # a list of dicts
        datasets = pytest.importorskip("datasets")
        ds = datasets.Dataset.from_list([ROWS[1], ROWS[1]])  # one format per dataset (Arrow's columns)
        assert [p.chosen.tolist() for p in train.read_pairs(ds, m)] == [pairs[1].chosen.tolist()] * 2


@pytest.mark.parametrize(
    "row,match",
    [
        ({"prompt": "a", "chosen": "x", "rejected": "x"}, "'chosen' and 'rejected' are the same answer"),
        ({"prompt": "a", "chosen": "x"}, "missing field 'rejected'"),
        ({"prompt": "a", "chosen": "  ", "rejected": "y"}, "field 'chosen' is empty"),
        ({"prompt": 1, "chosen": "x", "rejected": "y"}, "field 'prompt' must be a string; got int"),
        ({"chosen": [{"role": "assistant", "content": "a"}], "rejected": [{"role": "assistant", "content": "b"}]},
         "must begin with the same messages"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}],
          "rejected": [{"role": "assistant", "content": "b"}]}, "the chosen answer must begin with an assistant"),
        ({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": "b"}, "field 'chosen' must be a"),
        ([1, 2], "a pair must be a JSON object; got list"),
    ],
)  # fmt: skip
def test_bad_pairs_name_the_line_and_field(row, match, model_path, tmp_path):
    """Issue 58 item 7: a bad row is a ValueError naming the file, line and field; nothing is returned."""
    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with llamabind.Model(model_path, vocab_only=True) as m:
        with pytest.raises(ValueError, match=f"pairs.jsonl:2: .*{match}"):
            train.read_pairs(path, m)
        path.write_text("\n\n")
        with pytest.raises(ValueError, match="pairs.jsonl: no preference pairs"):
            train.read_pairs(path, m)
        with pytest.raises(FileNotFoundError):
            train.read_pairs(tmp_path / "none.jsonl", m)


def test_pair_logps_and_losses_match_pytorch(smollm2_f32_cut, reference_python, tmp_path):
    """The answers' log-probabilities of SmolLM2's F32 copy cut to a few blocks equal transformers' on the
    same GGUF (F32 on both sides, sums of 1-12 tokens' log-softmax in float64: within 2e-3 nats, the
    order of the products' sums differing; offloaded to a GPU, cuBLAS's TF32 products: 2e-3 relative, 7e-4
    measured on an H100), and DPO's and ORPO's loss and reward metrics equal the reference's formulas on
    the same log-probs (float64 both: 1e-9)."""
    with llamabind.Model(smollm2_f32_cut, repack=False, n_threads=2) as m:
        pairs = train.read_pairs(ROWS, m)
        ours = train.pair_logps(m, pairs)
        m_on_gpu = any(d["type"] == "gpu" for d in llamabind.devices())
    rng = np.random.default_rng(0)
    reference = ours + rng.normal(0, 2, ours.shape)  # a reference model's log-probs: any other numbers
    lengths = np.array([[len(p.chosen), len(p.rejected)] for p in pairs])
    job = {
        "gguf": str(smollm2_f32_cut),
        "pairs": [[p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()] for p in pairs],
        "policy": ours.tolist(), "reference": reference.tolist(), "lengths": lengths.tolist(), "beta": 0.3,
    }  # fmt: skip
    ref = reference_job(reference_python, "preference_reference.py", tmp_path, job, timeout=600)
    print("log-probs, llamabind / PyTorch:", ours.round(4).tolist(), np.round(ref["logps"], 4).tolist())
    if m_on_gpu:  # cuBLAS runs F32 products in TF32 (operands rounded to 10 mantissa bits, 4.9e-4 relative):
        np.testing.assert_allclose(ours, ref["logps"], rtol=2e-3)  # H100: 7e-4 relative on these sums
    else:
        np.testing.assert_allclose(ours, ref["logps"], atol=2e-3, rtol=0)
    got = {
        "dpo": train.preference_metrics(ours, reference, beta=0.3),
        "orpo": train.preference_metrics(ours, method="orpo", lengths=lengths, beta=0.3),
    }
    for method, mine in got.items():
        for field, want in ref[method].items():
            assert getattr(mine, field) == pytest.approx(want, rel=1e-9, abs=1e-12), (method, field)


def test_preference_metrics_refuse_what_they_cannot_compute():
    lp = np.array([[-1.0, -2.0]])
    for kw, match in [
        (dict(beta=0), "beta must be > 0"),
        (dict(beta=0.1), "DPO needs reference_logps"),
        (dict(reference_logps=np.zeros((2, 2))), r"reference_logps must be \(1, 2\)"),
        (dict(method="orpo"), "ORPO needs the answers' lengths"),
        (dict(method="kto", reference_logps=lp), "method must be 'dpo' or 'orpo'"),
    ]:
        with pytest.raises(ValueError, match=match):
            train.preference_metrics(lp, **kw)


def test_cli_eval_pairs_prints_trls_metrics(model_path, tmp_path, capsys):
    """``eval --pairs`` (issue 58 item 3, the metrics half): ORPO's numbers are preference_metrics' on
    pair_logps of the model, its nll over the chosen prompt and answer (TRL's; ``--no-prompt-loss``: the answer's
    only); DPO of an adapter whose B is zero (lora_init: the policy is the base) has the
    rewards 0 and the loss log 2 exactly; without an adapter DPO is refused, as are --data and --pairs
    together, each with one error line."""
    from llamabind import cli

    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        pairs = train.read_pairs(path, m, method="orpo")  # ORPO's tokenization: BOS first, EOS after the answers
        lengths = np.array([[len(p.chosen), len(p.rejected)] for p in pairs])
        lp = train.pair_logps(m, pairs, prompt=True)  # + the chosen prompts' log-likelihood and token count
        nll = -(lp[:, 0].sum() + lp[:, 2].sum()) / (lengths[:, 0].sum() + lp[:, 3].sum())  # TRL: prompt + answer
        want = train.preference_metrics(lp[:, :2], method="orpo", lengths=lengths, beta=0.2, nll=nll)
        answers = train.preference_metrics(lp[:, :2], method="orpo", lengths=lengths, beta=0.2)
        assert nll != pytest.approx(-lp[:, 0].sum() / lengths[:, 0].sum())
        train.lora_init(m, tmp_path / "zero.gguf", 2, 4.0, ["attn_q"])
    base = ["eval", "-m", str(model_path), "--pairs", str(path), "-t", "2"]
    for extra, metrics in (([], want), (["--no-prompt-loss"], answers)):
        assert cli.main([*base, "--method", "orpo", "--beta", "0.2", *extra]) == 0
        out = capsys.readouterr().out
        assert f"orpo over 3 pairs: loss {metrics.loss:.4f}" in out, out
        assert f"rewards/margins {metrics.rewards_margins:.4f}" in out
    assert cli.main([*base, "--lora", str(tmp_path / "zero.gguf")]) == 0
    out = capsys.readouterr().out
    assert f"loss {np.log(2):.4f}, rewards/chosen 0.0000, rewards/rejected 0.0000" in out, out
    for extra, match in [([], "give --lora"), (["--data", str(path)], "one of them")]:
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert match in err and "Traceback" not in err, err


PAIR4 = {"prompt": "Water boils at", "chosen": " 100 degrees Celsius at sea level.", "rejected": " 12 degrees."}


def _step_losses(m, adapter, win, lab, refs, lengths, method, optimizer, lr, wd, steps, beta):
    """[(loss from the graph's per-window log-likelihoods in float64, ggml-opt's loss of the graph)] of
    ``steps`` optimizer steps of a LoRA ``adapter`` on the pairs' windows as one micro-batch."""
    kw = dict(ctx_size=256, batch_size=len(win), optimizer=optimizer, lr=lr, weight_decay=wd, precision="f32")
    out = []
    with train.Trainer(m, **kw, params="lora", adapter=adapter, loss=method, beta=beta, n_threads=2) as t:
        for _ in range(steps):
            t.optimizer.reset()
            t.optimizer.eval(win, True, lab, refs)
            logps = t.optimizer.seq_logps().reshape(-1, 2)
            ref = np.stack([refs, np.zeros_like(refs)], axis=1)
            mine = train.preference_metrics(logps, ref, method=method, beta=beta, lengths=lengths)
            out.append((mine.loss, t.optimizer.result(True)[0]))
    return out


def test_dpo_and_orpo_step_match_pytorch(smollm2_f32_cut, reference_python, tmp_path):
    """Patch 0054 (the loss of each ubatch's pairs built in the training graph) against PyTorch written from
    the papers (tests/preference_train_reference.py): a LoRA on attn_v/attn_output over SmolLM2's F32 blocks,
    four pairs (eight windows) in one graph: the DPO and ORPO loss, each adapter tensor's gradient (from an
    SGD step of lr 1) and three AdamW steps, within the SFT LoRA parity test's tolerances (F32 on both sides;
    the loss 1e-4 relative, gradient cosines >= 0.9999, the adapters 1e-4 relative for the median tensor).
    The graph's own loss (ggml-opt's result, F32 scalars) equals the float64 formula on its per-window
    log-likelihoods within 1e-5 relative. Offloaded to a GPU, ggml-cuda's cuBLAS runs the F32 products in TF32
    (operands rounded to 10 mantissa bits, 4.9e-4 relative): the losses within 2e-3 relative and the gradient
    cosines >= 0.999; the adapters after AdamW are printed, not compared (Adam's update is about lr per element
    whatever the gradient's size, so an element whose gradient TF32 rounding moves by its own size moves by lr)."""
    rank, alpha, lr, wd, n_steps, beta = 4, 8.0, 1e-4, 0.01, 3, 0.3
    from llamabind.model import write_lora_gguf

    job = dict(f32=str(smollm2_f32_cut), beta=beta, scale=alpha / rank, lr=lr, weight_decay=wd, adamw_steps=n_steps)
    ours = {}
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False) as m:
        on_gpu = bool(m.output_offloaded)
        pairs = train.read_pairs([*ROWS, PAIR4], m)
        win, lab, lengths, cut = train.pair_windows(pairs, 256, m.token_eos)
        assert cut == 0 and win.shape == (8, 257) and (lengths > 0).all()
        refs = np.random.default_rng(3).normal(0, 1, len(pairs))
        job.update(windows=win.tolist(), labels=lab.tolist(), refs=refs.tolist())
        train.lora_init(m, tmp_path / "zero.gguf", rank, alpha, ["attn_v", "attn_output"], seed=1)
        rng = np.random.default_rng(2)  # B = 0 gives A no gradient: start from a B with values
        init = {n: (rng.normal(0, 0.02, a.shape).astype(np.float32) if n.endswith("lora_b") else np.asarray(a))
                for n, a in _read_lora(tmp_path / "zero.gguf").items()}  # fmt: skip
        write_lora_gguf(tmp_path / "init.gguf", "llama", alpha, sorted(init.items()))
        for method in ("dpo", "orpo"):
            files = {k: str(tmp_path / f"{method}-{k}.gguf") for k in ("init", "sgd", "adamw")}
            files["init"] = str(tmp_path / "init.gguf")
            for k, optimizer, step_lr, steps in (("sgd", "sgd", 1.0, 1), ("adamw", "adamw", lr, n_steps)):
                adapter = m.load_lora(files["init"])
                ours[method, k] = _step_losses(m, adapter, win, lab, refs, lengths, method, optimizer, step_lr,
                                               wd if k == "adamw" else 0.0, steps, beta)  # fmt: skip
                adapter.save(files[k])
                adapter.close()
            job[method] = files
    ref = reference_job(reference_python, "preference_train_reference.py", tmp_path, job)
    for method in ("dpo", "orpo"):
        want, (loss0, graph0) = ref[method], ours[method, "sgd"][0]
        adamw = [a for a, _ in ours[method, "adamw"]]
        cos, rel = want["grad_cosine"], want["adamw_rel"]
        print(f"{method}: loss llamabind {loss0:.6f} (graph {graph0:.6f}), PyTorch {want['loss']:.6f}; AdamW",
              [f"{a:.5f}/{b:.5f}" for a, b in zip(adamw, want["adamw_losses"])], "lowest cosine",
              min(cos.values()), "adapter differences median", np.median(list(rel.values())))  # fmt: skip
        assert graph0 == pytest.approx(loss0, rel=1e-5)
        assert abs(loss0 - want["loss"]) <= (2e-3 if on_gpu else 1e-4) * want["loss"], method
        np.testing.assert_allclose(adamw, want["adamw_losses"], rtol=2e-3 if on_gpu else 5e-4)
        assert len(cos) == len(init) and min(cos.values()) >= (0.999 if on_gpu else 0.9999), sorted(cos.items())[:3]
        if on_gpu:
            continue
        assert np.median(list(rel.values())) <= 1e-4, sorted(rel.items(), key=lambda kv: kv[1])[-3:]
        assert max(rel.values()) <= 1e-3, sorted(rel.items(), key=lambda kv: kv[1])[-3:]


def _read_lora(path):
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: np.array(t.data).reshape(list(reversed([int(n) for n in t.shape]))) for t in r.tensors}


@pytest.fixture(scope="module")
def doc_pairs(smollm2_f32_cut):
    """60 pairs from Python's own reference text (pydoc_data.topics): the prompt a topic's first 20 words, the
    chosen answer its next 20, the rejected answer the model's own greedy continuation of 24 tokens (what a
    preference run against the base model's style would use). The first 48 train, the last 12 are held out."""
    import re
    from pydoc_data.topics import topics

    texts = [re.sub(r"\s+", " ", topics[k]).strip() for k in sorted(topics)]
    texts = [t for t in texts if len(t) > 400][:60]
    rows = []
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False) as m:
        for t in texts:
            words = t.split(" ")
            prompt = " ".join(words[:20])
            greedy = m.generate(prompt, max_tokens=24, temperature=0.0).text
            rows.append({"prompt": prompt, "chosen": " " + " ".join(words[20:40]), "rejected": greedy})
    return rows


@pytest.mark.parametrize("method,lr", [("dpo", 1e-4), ("orpo", 1e-3)])
def test_preference_tuning_learns_held_out_pairs(method, lr, doc_pairs, smollm2_f32_cut, tmp_path):
    """Issue 58 item 5: LoRA r8 over SmolLM2's F32 blocks, 12 steps of 4 pairs. DPO: the held-out reward
    accuracy goes from 0 (the policy is the reference) to >= 0.9 and the margin grows at each validation;
    the saved adapter, loaded again, ranks the held-out pairs the same way through llama_decode
    (pair_logps against the base model, another code path than the training graph). ORPO (no reference;
    its rewards are beta x mean token log-probs, where the greedy answer starts far ahead): the held-out loss
    falls and the margin grows at each validation. The tuned adapter generates."""
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False) as m:
        pairs = train.read_pairs(doc_pairs, m)
        r = train.preference(m, pairs[:48], valid=pairs[48:], method=method, beta=0.1, lora_rank=8, lr=lr,
                             batch_size=4, steps_per_eval=6, progress=False, n_threads=2)  # fmt: skip
        margins = [r.val_before.rewards_margins] + [e.rewards_margins for _, e in r.evals]
        print(method, "held-out margins", margins, "accuracies", [e.rewards_accuracies for _, e in r.evals],
              "losses", [r.val_before.loss] + [e.loss for _, e in r.evals])  # fmt: skip
        assert r.steps == 12 and [s for s, _ in r.evals] == [6, 12] and len(r.metrics) == 12
        assert margins[0] < margins[1] < margins[2]
        assert r.evals[-1][1].loss < r.val_before.loss
        if method == "dpo":
            assert r.val_before.rewards_accuracies == 0.0 and r.val_before.loss == pytest.approx(np.log(2))
            assert r.evals[-1][1].rewards_accuracies >= 0.9
        r.adapter.save(tmp_path / "tuned.gguf")
        r.adapter.close()
        tuned = m.load_lora(tmp_path / "tuned.gguf")
        if method == "dpo":
            policy = train.pair_logps(m, pairs[48:], adapter=tuned)
            reference = train.pair_logps(m, pairs[48:])
            again = train.preference_metrics(policy, reference, beta=0.1)
            assert again.rewards_accuracies >= 0.9
            # the same numbers on the CPU (F32 both ways: 1e-3); on a GPU the training graph's products run in
            # BF16 (8 mantissa bits, 3.9e-3 relative) and llama_decode's in TF32: 5.5e-3 measured on an H100
            tol = 2e-2 if m.output_offloaded else 1e-3
            assert again.rewards_margins == pytest.approx(r.evals[-1][1].rewards_margins, rel=tol)
        ctx = m.context(n_ctx=256)
        ctx.set_lora(tuned, 1.0)
        from llamabind import generation

        assert generation.generate(ctx, doc_pairs[50]["prompt"], max_tokens=8, temperature=0.0).text
        ctx.close()


def test_preference_checkpoints_resume_to_the_same_steps(doc_pairs, smollm2_f32_cut, tmp_path, monkeypatch):
    """A DPO run resumed from its step-2 checkpoint takes steps 3 and 4 as the uninterrupted run does (the
    reference log-probabilities and AdamW's state come from the checkpoint), and a checkpoint of another
    method is refused by name. On a CUDA GPU with flash attention's deterministic backward: by default its dQ is
    summed by atomics (as SDPA's), whose order changes the last bits run to run, and AdamW's second step turned
    that into 1.6e-3 of step 4's loss on an H200, the same run twice (packed or not)."""
    monkeypatch.setenv("GGML_CUDA_FA_BACK_DETERMINISTIC", "1")  # read at each FLASH_ATTN_BACK; the CPU's is fixed
    kw = dict(method="dpo", lora_rank=4, lr=1e-4, batch_size=2, iters=4, val_split=0.0, progress=False, n_threads=2)
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False) as m:
        pairs = train.read_pairs(doc_pairs[:8], m)
        whole = train.preference(m, pairs, checkpoint_dir=tmp_path / "a", save_every=2, **kw)
        assert [c.name for c in whole.checkpoints] == ["step-0000002", "step-0000004"]
        resumed = train.preference(
            m, pairs, checkpoint_dir=tmp_path / "b", resume=tmp_path / "a" / "step-0000002", **kw
        )
        print("losses", whole.losses, resumed.losses)
        assert resumed.steps == 4 and resumed.losses[:2] == whole.losses[:2]
        np.testing.assert_allclose(resumed.losses[2:], whole.losses[2:], rtol=1e-5)
        with pytest.raises(ValueError, match="method 'dpo' there, 'orpo' now"):
            train.preference(m, pairs, resume=tmp_path / "a" / "step-0000002", **{**kw, "method": "orpo"})


def test_preference_refuses_bad_settings_before_training(model_path, tmp_path):
    """Issue 58 item 7: a clear error naming the argument, before any training: an unknown method, beta <= 0,
    fewer pairs than batch_size, an odd window count for the loss, a bad row (file and line), an answer
    without a token in its window."""
    with llamabind.Model(model_path, repack=False, n_threads=2) as m:
        pairs = train.read_pairs(ROWS, m)
        for kw, err, match in [
            (dict(method="kto"), ValueError, "method must be one of"),
            (dict(beta=0.0), ValueError, "beta must be a finite number > 0"),
            (dict(beta=float("nan")), ValueError, "beta must be (a )?finite"),
            (dict(batch_size=4, val_split=0.0), ValueError, "batch_size 4 is larger than the 3 training pair"),
            (dict(lr=-1), ValueError, "lr must be > 0"),
            (dict(ctx_size=300), ValueError, "ctx_size must be a multiple of 256"),
        ]:
            with pytest.raises(err, match=match):
                train.preference(m, pairs, lora_rank=8, progress=False, **kw)
        path = tmp_path / "pairs.jsonl"
        path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
        with pytest.raises(ValueError, match="pairs.jsonl:2: missing field 'rejected'"):
            train.preference(m, path, lora_rank=8, progress=False)
        no_prompt = train.PreferencePair(np.zeros(0, np.int32), np.array([5], np.int32), np.array([6, 7], np.int32))
        with pytest.raises(ValueError, match="data: pair 0: its chosen answer has no token to learn"):
            train.preference(m, [no_prompt, *pairs], lora_rank=8, progress=False, val_split=0.0)
        from llamabind.context import Context
        from llamabind.optimizer import Optimizer

        with Context(m, n_ctx=768, n_batch=768, n_ubatch=768, n_seq_max=3, training=True) as ctx:
            with pytest.raises(ValueError, match="n_seq_max must be even"):
                Optimizer(ctx, params="model", loss="dpo")


def test_cli_finetune_dpo(smollm2_f32_cut, doc_pairs, tmp_path):
    """``python -m llamabind finetune --method dpo --data pairs.jsonl --lora-rank 8 --pack``: trains (the pairs
    packed, each prompt once: --pack reaches train.preference), prints TRL's metrics, writes an adapter that loads."""
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in doc_pairs[:20]))
    out = tmp_path / "dpo.gguf"
    cmd = [sys.executable, "-m", "llamabind", "finetune", "-m", str(smollm2_f32_cut), "--method", "dpo", "--data",
           str(data), "--lora-rank", "8", "--lr", "1e-4", "--batch", "2", "--iters", "3", "-o", str(out), "-t", "2",
           "--pack", "--no-progress", "--steps-per-report", "1"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "held-out pairs before: loss 0.6931" in r.stdout and "held-out pairs after:" in r.stdout, r.stdout
    assert "3 optimizer steps of 2 pair(s), dpo with beta 0.1" in r.stdout and "step 3/3: loss" in r.stderr
    with llamabind.Model(smollm2_f32_cut, vocab_only=False, n_threads=2) as m:
        m.load_lora(out).close()
    bad = subprocess.run([*cmd[:-2], "--beta", "-1"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "beta must be" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_dpo_first_step_loss_is_ln_2(kind, smollm2_f32_cut):
    """Issue 83 item 3: at step 1 the policy is the reference, so DPO's loss is ln 2 and its rewards 0, whatever the
    backend and precision, provided the reference log-probabilities (forward-only evaluations before training) come
    from the same numbers as the policy's (the training graph's forward pass). Pairs of 7/8 of a 512-token window
    (224-token prompts, 168-token answers: bench/preference.py's), so that a per-token difference between the two
    paths sums to a visible reward: on an H200 the 1B shape's first loss was 0.7060. On the CPU the same float
    sums (bit for bit: exactly ln 2); on a GPU within 1e-4, each precision the run takes (default: BF16 products)."""
    from pydoc_data.topics import topics

    with llamabind.Model(smollm2_f32_cut, use_mmap=kind == "lora", repack=False, n_threads=2) as m:
        toks = [m.tokenize(topics[k], add_special=False) for k in sorted(topics)]
        toks = [t for t in toks if len(t) >= 392][:5]
        pairs = [train.PreferencePair(*(np.asarray(x, np.int32) for x in (t[:224], t[224:392], o[224:392])))
                 for t, o in zip(toks, toks[1:])]  # fmt: skip
        on_gpu = bool(m.output_offloaded)
        r = train.preference(
            m, pairs, method="dpo", beta=0.1, ctx_size=512, batch_size=4, iters=1, val_split=0.0, shuffle=False,
            lora_rank=8 if kind == "lora" else None, lr=1e-4 if kind == "lora" else 1e-6, progress=False, n_threads=2,
        )  # fmt: skip
    first = r.metrics[0]
    print(kind, "first loss", r.losses[0], "rewards", first.rewards_chosen, first.rewards_rejected)
    if on_gpu:
        assert r.losses[0] == pytest.approx(np.log(2), abs=1e-4)
        assert abs(first.rewards_chosen) < 2e-3 and abs(first.rewards_rejected) < 2e-3
    else:
        assert r.losses[0] == pytest.approx(np.log(2), abs=1e-6)
        assert first.rewards_chosen == 0.0 and first.rewards_rejected == 0.0


def _topic_pairs(m, n: int, prompt: int, answer: int) -> list:
    """n pairs from Python's reference text: a topic's first ``prompt`` tokens, its next ``answer`` tokens (chosen)
    and as many of the next topic's (rejected); bench/preference.py's pairs."""
    from pydoc_data.topics import topics

    toks = [m.tokenize(topics[k], add_special=False) for k in sorted(topics)]
    toks = [t for t in toks if len(t) >= prompt + answer][: n + 1]
    p, e = prompt, prompt + answer
    return [train.PreferencePair(*(np.asarray(x, np.int32) for x in (t[:p], t[p:e], o[p:e])))
            for t, o in zip(toks, toks[1:])]  # fmt: skip


@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_packed_pairs_train_as_their_windows(method, doc_pairs, smollm2_f32_cut):
    """Issue 83 item 4 (patch 0101): ``pack=True`` lays a micro-batch's pairs into one window with each prompt once
    (the rejected answer sees the chosen window's prompt tokens as its own: shared tokens of two documents) and the
    window fitted to the pairs (not ctx_size x 2 x pairs). The same math as the unpacked windows: every step's loss,
    rewards and log-probabilities, the held-out metrics and the trained weights equal the unpacked run's within float
    rounding (the attention sums run over other rows; measured ~1e-7 relative on the CPU; the held-out metrics
    after the steps carry the trained weights' differences), DPO and ORPO (with its nll over the
    chosen prompt: the shared tokens are labelled for the chosen document), LoRA, 2 micro-batches a step; pairs of
    different lengths, a held-out set shorter than a micro-batch (filled with copies of the shortest pair)."""
    kw = dict(method=method, beta=0.1, lora_rank=8, lr=1e-3, batch_size=4, grad_accum=2, iters=3, shuffle=False,
              progress=False, n_threads=2, ctx_size=256)  # fmt: skip
    runs = {}
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False) as m:
        on_gpu = bool(m.output_offloaded)
        pairs = train.read_pairs(doc_pairs[:12], m, method=method)
        for pack in (False, True):
            r = train.preference(m, pairs[:9], valid=pairs[9:], pack=pack, **kw)
            runs[pack] = r
            r.adapter.close()
    a, b = runs[False], runs[True]
    print(method, "losses", a.losses, b.losses)
    # a GPU's BF16 products round each layout's sums otherwise: 2e-5 at step 1 on an H200, then the steps part
    # (lr 1e-3 moves DPO's loss from 0.69 to 0.25 in 2 steps: 0.75% apart measured); the CPU's F32: ~1e-7
    first, later = (1e-3, 3e-2) if on_gpu else (2e-5, 2e-5)
    np.testing.assert_allclose(b.losses[0], a.losses[0], rtol=first)
    np.testing.assert_allclose(b.losses, a.losses, rtol=later)
    for tol, x, y in [(first, a.val_before, b.val_before), (first, a.metrics[0], b.metrics[0])] + [
        (later, x, y) for x, y in zip(a.metrics[1:] + [a.evals[-1][1]], b.metrics[1:] + [b.evals[-1][1]])
    ]:
        got, want = (np.array([r.logps_chosen, r.logps_rejected, r.rewards_margins]) for r in (y, x))
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("pack", [False, True])
def test_dpo_keeps_its_graphs_while_the_rows_repeat(pack, smollm2_f32_cut):
    """Issue 83 item 4 (patch 0101): a preference loss no longer rebuilds llama's and ggml-opt's graphs for every
    micro-batch. Micro-batches of the same rows (pairs of equal lengths: bench/preference.py's) reuse the graphs
    built first and the kept batch; the reference log-ratios, which differ between them, are an input of the
    graph. Forward-only evals of the same pairs with three sets of refs: one graph build, the later evals on the
    kept batch, the same log-probabilities each time, and each eval's loss is DPO's formula of those log-probabilities
    and its own refs (a loss that kept the first refs baked in would fail the second and third). Pairs of other
    lengths then rebuild once. Windows and packed (shared prompts)."""
    from llamabind.train.preference_loop import pack_pairs, pair_spans

    beta = 0.1
    with llamabind.Model(smollm2_f32_cut, n_threads=2, repack=False, use_mmap=False) as m:
        pairs = _topic_pairs(m, 3, 40, 24)
        win, lab, _, _ = train.pair_windows(pairs[:2], 256, 0)
        other, olab, _, _ = train.pair_windows([pairs[2], train.PreferencePair(pairs[2].prompt, pairs[2].chosen[:9],
                                                                              pairs[2].rejected)], 256, 0)  # fmt: skip
        ctx, batch = (256, 2) if pack else (256, 4)
        with train.Trainer(m, ctx_size=ctx, batch_size=1 if pack else batch, loss="dpo", beta=beta,
                           pack=pack, n_threads=2) as t:  # fmt: skip
            opt = t.optimizer

            def run(w, lb, refs):
                if pack:
                    w, lb, seg, sh = pack_pairs(w, lb, pair_spans(w, lb), ctx, 0)
                    opt.reset()
                    opt.eval(w, False, lb, refs, segments=seg, shared=sh)
                else:
                    opt.reset()
                    opt.eval(w, False, lb, refs)
                return opt.seq_logps().reshape(-1, 2), opt.result(False)[0]

            seen = []
            for refs in (np.zeros(2), np.array([3.5, -2.0]), np.array([-1.25, 0.5])):
                lp, loss = run(win, lab, refs)
                z = beta * ((lp[:, 0] - lp[:, 1]) - refs)
                assert loss == pytest.approx(np.mean(np.logaddexp(0.0, -z)), rel=1e-5)
                seen.append(lp)
            s = opt.stats()
            print("pack", pack, "stats", {k: s[k] for k in ("n_evals", "n_graph_builds", "n_kept_batches")})
            assert s["n_evals"] == 3 and s["n_graph_builds"] == 1 and s["n_kept_batches"] == 2
            np.testing.assert_array_equal(seen[1], seen[0])
            np.testing.assert_array_equal(seen[2], seen[0])
            run(other, olab, np.zeros(2))
            assert opt.stats()["n_graph_builds"] == 2
