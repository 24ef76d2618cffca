"""Validation-loss gaps (PACI vs flush) of the authors' runtime and of paci-megatron, side by side.

    python benchmarks/fidelity_table.py --theirs FLUSH.json PACI.json --ours DIR [--runs paci,paci-drain]

FLUSH.json / PACI.json: what the fidelity driver of the authors' code writes
({"evals": [[iteration, loss], ...]}); DIR: a `paci_megatron.tools.compare` output directory
(`1f1b.jsonl` and one `NAME.jsonl` per PACI run). Prints one markdown row per evaluation.
"""
import argparse
import json
import os


def their_curve(path):
    with open(path) as f:
        return {int(i): v for i, v in json.load(f)["evals"]}


def our_curve(path):
    curve = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line) if line.strip() else {}
            if r.get("validation_loss") is not None and "iteration" in r:
                curve[int(r["iteration"])] = r["validation_loss"]
    return curve


def gap(paci, flush):
    return 100.0 * (paci / flush - 1.0)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--theirs", nargs=2, metavar=("FLUSH_JSON", "PACI_JSON"), required=True)
    p.add_argument("--ours", required=True, metavar="DIR")
    p.add_argument("--runs", default="paci", help="our PACI runs, comma-separated")
    a = p.parse_args()
    t_flush, t_paci = (their_curve(x) for x in a.theirs)
    o_flush = our_curve(os.path.join(a.ours, "1f1b.jsonl"))
    runs = a.runs.split(",")
    o_paci = {r: our_curve(os.path.join(a.ours, f"{r}.jsonl")) for r in runs}
    last = max(t_flush)
    print("| update | % of training | theirs flush | theirs PACI | their gap | ours 1F1B | "
          + " | ".join(f"ours {r} | our gap ({r}) | difference ({r}), pp" for r in runs) + " |")
    print("|" + "---|" * (6 + 3 * len(runs)))
    for it in sorted(t_flush):
        tg = gap(t_paci[it], t_flush[it])
        cells = [str(it), f"{100 * it // last}%", f"{t_flush[it]:.4f}", f"{t_paci[it]:.4f}",
                 f"{tg:+.2f}%", f"{o_flush[it]:.4f}"]
        for r in runs:
            og = gap(o_paci[r][it], o_flush[it])
            cells += [f"{o_paci[r][it]:.4f}", f"{og:+.2f}%", f"{og - tg:+.2f}"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
