"""How the SiLU -> ReLU swap is made, measured at small scale: the same short relufication run
of a model with the swap made at once (blend 0) and blended over the first part of training,
same seed, data and steps; prints the held-out perplexity and exact-zero share of each.

    python benches/relufy_swap.py [--model M.gguf] [--corpus DIR] [--steps 60] [--batch 4]
        [--seq-len 128] [--blends 0,0.3] [--activation reglu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings

from powerinfer_rs.models import default_model_path
from powerinfer_rs.offline import relufication as relufy


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=None)
    ap.add_argument("--corpus", default="/usr/share/doc/python3.11/html/_sources/tutorial")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--l1", type=float, default=0.0)
    ap.add_argument("--blends", default="0,0.3")
    ap.add_argument("--activation", default="reglu")
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    model = a.model or default_model_path()
    warnings.simplefilter("ignore")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for blend in (float(b) for b in a.blends.split(",")):
            s = relufy.RelufySettings(
                activation=a.activation,
                steps=a.steps,
                batch=a.batch,
                seq_len=a.seq_len,
                lr=a.lr,
                l1=a.l1,
                blend=blend,
            )
            t = time.time()
            r = relufy.relufy(
                model,
                [a.corpus],
                os.path.join(tmp, "out.gguf"),
                s,
                eval_tokens=a.eval_tokens,
                progress=False,
            )
            rows.append(
                {
                    "blend": blend,
                    "ppl_original": r["ppl_original"],
                    "ppl_relufied": r["ppl_relufied"],
                    "kl": r["kl_relufied"],
                    "sparsity": r["sparsity"],
                    "train_tokens": r["train_tokens"],
                    "seconds": time.time() - t,
                    "curve": r["curve"],
                }
            )
            print(
                f"blend {blend:.2f}: ppl {r['ppl_original']:.2f} -> {r['ppl_relufied']:.2f}, KL {r['kl_relufied']:.4f}, "
                f"zeros {r['sparsity']:.1%} after {r['train_tokens']} tokens ({time.time() - t:.0f} s)",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                {
                    "model": os.path.basename(model),
                    "activation": a.activation,
                    "steps": a.steps,
                    "batch": a.batch,
                    "seq_len": a.seq_len,
                    "lr": a.lr,
                    "l1": a.l1,
                    "runs": rows,
                },
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
