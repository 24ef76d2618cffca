"""Drive the PACI authors' runtime (github.com/ItayElam/PACI, patched for CPU as described in
benchmarks/studies/07-fidelity-authors.md) on tinyshakespeare, P=4, flush or PACI:

    OMP_NUM_THREADS=1 PACI_PORT=29412 python benchmarks/fidelity_authors.py \
        --authors-root /tmp/paci_authors --mode paci --iters 200 --warmup 10 --eval-every 50 --out X.json

Data: the exact Megatron GPTDataset samples paci-megatron's run reads (same prefix, split,
seed, sample counts), in the same order; validation: the first eval_iters batches of the
validation split at every evaluation, as paci_megatron.training.evaluate does.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
from torch.optim.lr_scheduler import LambdaLR

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def authors_root():
    # before argparse: the spawned workers re-import this module and need DistPACI too
    root = os.environ.get("PACI_AUTHORS_ROOT", "/tmp/paci_authors")
    for i, arg in enumerate(sys.argv[:-1]):
        if arg == "--authors-root":
            root = os.environ["PACI_AUTHORS_ROOT"] = sys.argv[i + 1]
    return root


sys.path.insert(0, authors_root())
from DistPACI import TrainingConfig, PACIModel, PACIMode, LRstepMode, PipelineMethods  # noqa: E402
from Models.GPT2 import GPT2SequentialModel, GPTConfig  # noqa: E402


def build_adamw(model, lr=1e-4, weight_decay=1e-2, betas=(0.9, 0.95), eps=1e-8):
    # the settings of the authors' TrainGPT.py: AdamW, weight decay on matrices only
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


class WarmupCosine:
    # the authors' schedule (TrainGPT.py): linear warm-up from 0, cosine to min_ratio x peak
    def __init__(self, warmup, total, min_ratio=0.1):
        self.warmup, self.total, self.min_ratio = warmup, total, min_ratio

    def __call__(self, step):
        if step < self.warmup:
            return step / float(max(1, self.warmup))
        if step >= self.total:
            return self.min_ratio
        t = (step - self.warmup) / float(max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class CELoss:
    # token-mean cross entropy, as the authors' loss (their Utils.metrics imports sklearn)
    def __call__(self, output, target):
        return torch.nn.functional.cross_entropy(
            output.view(-1, output.size(-1)), target.view(-1), ignore_index=-100)


def megatron_splits(a):
    sys.path.insert(0, a.paci_megatron_root)
    from paci_megatron.mcore import data
    tok = data.build_tokenizer("SentencePieceTokenizer", a.tokenizer_model, vocab_size=a.vocab)
    evals = a.iters // a.eval_every + 1
    train, valid, _ = data.build_gpt_datasets(
        a.data_path, "95,5,0", a.seq, a.seed, tok, train_samples=a.iters * a.gbs,
        valid_samples=a.eval_iters * a.gbs * evals, test_samples=a.gbs)
    return train, valid


def batch(ds, start, n):
    rows = [ds[start + i] for i in range(n)]
    tokens = torch.stack([torch.as_tensor(r["tokens"]).long() for r in rows])
    labels = torch.stack([torch.as_tensor(r["labels"]).long() for r in rows])
    return tokens, labels


def mean_loss(results):
    vals = [r.get_data(wait=True) for r in results]
    return sum(v["loss"] * v["tokens"] for v in vals) / sum(v["tokens"] for v in vals)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["paci", "flush"], required=True)
    p.add_argument("--a", type=int, default=4)
    p.add_argument("--gbs", type=int, default=16)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--eval-every", type=int, default=75)
    p.add_argument("--eval-iters", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2000)
    p.add_argument("--data-path", default="/tmp/cmp_shk/shakespeare_text_document")
    p.add_argument("--tokenizer-model", default="/tmp/cmp_shk/spm.model")
    p.add_argument("--authors-root", default=authors_root(), help="patched checkout of ItayElam/PACI")
    p.add_argument("--paci-megatron-root", default=REPO)
    p.add_argument("--out", required=True)
    a = p.parse_args()

    train, valid = megatron_splits(a)
    torch.manual_seed(a.seed)
    model = GPT2SequentialModel(config=GPTConfig(
        context_length=a.seq, vocab_size=a.vocab, num_layers=4, embd_size=128, num_heads=4))
    # P=4 like Megatron's layout: [emb, layer0] [layer1] [layer2] [layer3, final LN, output]
    split = [[0, 1, 2], [3, 4], [5, 6], [7, 8, 9, 10]]
    config = TrainingConfig(
        model, build_optimizer_func=build_adamw, device="cpu", grad_accumulation=a.a,
        optimizer_params={"lr": a.lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1},
        total_steps=a.iters, pipeline_mode=getattr(PipelineMethods, a.mode),
        paci_mode=PACIMode.perf, split_to=4, loss_function=CELoss(),
        lr_scheduler_class=LambdaLR,
        lr_scheduler_params={"lr_lambda": WarmupCosine(a.warmup, a.iters)},
        lr_step_on=LRstepMode.step, output_verbose=False, ignore_token=-100)
    paci = PACIModel(model, config, measure_iterations=1)
    paci.init(batch(train, 0, a.gbs)[0], split)

    record = {"mode": a.mode, "a": a.a, "seed": a.seed, "iters": a.iters, "evals": [],
              "train": []}
    start = time.time()
    pending = []
    for step in range(1, a.iters + 1):
        pending.append((step, paci(*batch(train, (step - 1) * a.gbs, a.gbs))))
        if step % a.eval_every == 0:
            for s, res in pending:
                record["train"].append((s, mean_loss(res)))
            pending = []
            paci.eval()
            results = []
            for k in range(a.eval_iters):
                results += paci(*batch(valid, k * a.gbs, a.gbs))
            val = mean_loss(results)
            record["evals"].append((step, val))
            print(f"FIDELITY {a.mode} a={a.a} iteration {step} validation loss {val:.6f} "
                  f"train {record['train'][-1][1]:.4f} ({time.time() - start:.0f} s)", flush=True)
            paci.train()
    record["wall_s"] = time.time() - start
    with open(a.out, "w") as f:
        json.dump(record, f)
    paci.stop_training()
    os._exit(0)


if __name__ == "__main__":
    main()
