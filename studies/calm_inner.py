"""How far CALM's inner loop moves the surrogate, per inner step size and optimizer.

From the run's initial adapters (or any CALM config), for each (inner_optimizer, rho) pair:
T inner steps on each of the first `--batches` training batches, then the inner drop
g(theta) - g(theta~) on that batch (= the per-step residual q), its share of g, and the RMS
per-element move |theta~ - theta| / sqrt(n) next to the lower LR (about what one outer AdamW
step moves an element by). Config overrides as for `python -m calm_lightning.run`:

    python studies/calm_inner.py setting=ood setting.train.files=[/data/alpaca.jsonl] \\
        setting.batch_size=4 setting.max_length=128 -- --pairs sgd:1e-3 sgd:1e-1 adam:1e-3
    python studies/calm_inner.py model=tiny -- --batches 1 --pairs sgd:1e-2 adam:1e-3
"""

from __future__ import annotations

import argparse
import math
import sys

DEFAULT_PAIRS = ["sgd:1e-3", "sgd:1e-2", "sgd:1e-1", "sgd:1", "adam:1e-4", "adam:1e-3"]


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv and {"-h", "--help"} & set(argv):
        argv = ["--", *argv]  # no Hydra overrides: the help is the script's own
    overrides, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=DEFAULT_PAIRS, help="optimizer:rho")
    parser.add_argument("--batches", type=int, default=2, help="training batches probed")
    parser.add_argument("--inner-steps", type=int, default=20, help="T (paper: 20)")
    args = parser.parse_args(rest)

    import lightning as L
    from hydra import compose, initialize_config_module

    import calm_lightning.runtime.resolvers  # noqa: F401  (registers resolvers)
    from calm_lightning.evaluation.scorers import scorer_from_config
    from calm_lightning.methods.bome import InnerOptions, bilevel_gradients
    from calm_lightning.models.loading import load_language_model
    from calm_lightning.pipeline import build_datamodule, build_method

    with initialize_config_module("calm_lightning.conf", version_base="1.3"):
        cfg = compose("run", overrides=["method=calm", "paths.output_dir=/tmp/unused", *overrides])
    L.seed_everything(cfg.seed, verbose=False)
    loaded = load_language_model(cfg.model)
    scorer = scorer_from_config(cfg.evaluation)
    datamodule = build_datamodule(cfg, scorer, loaded.tokenizer)
    datamodule.setup("fit")
    module = build_method(cfg, loaded, scorer)
    # LoRA dropout off, as CALM measures q (its residual passes run without dropout): the
    # drop is then the inner steps' effect, not dropout noise.
    module.model.eval()
    module.upper_objective = "vocab"
    names, theta = module._theta()
    alpha = module._alpha()
    n_elements = sum(p.numel() for p in theta)
    batches = []
    for batch in datamodule.train_dataloader():
        item = batch[0] if isinstance(batch, tuple) else batch  # CombinedLoader: triples
        batches.append(item.get("train", item))
        if len(batches) == args.batches:
            break
    print(f"T={args.inner_steps}, {len(batches)} batches, lower LR {module.lower_lr:g}")
    print("| inner step | rho | g(theta) | inner drop | drop / g | RMS move | move / lower LR |")
    print("|---|---|---|---|---|---|---|")
    for pair in args.pairs:
        kind, rho = pair.split(":")
        drops, shares, moves, gs = [], [], [], []
        for batch in batches:
            lower = module.lower_loss_fn(batch, names)
            inner = InnerOptions(args.inner_steps, float(rho), kind, tuple(module.betas))
            grads = bilevel_gradients(
                theta, alpha, lower, lambda: sum(a.sum() for a in alpha) * 0.0, inner,
                keep_surrogate=True,
            )  # fmt: skip
            moved = sum(
                float((s - p.detach()).pow(2).sum())
                for s, p in zip(grads.surrogate, theta, strict=True)
            )
            gs.append(grads.g.item())
            drops.append(grads.q.item())
            shares.append(grads.q.item() / grads.g.item())
            moves.append(math.sqrt(moved / n_elements))
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(
            f"| {kind} | {float(rho):g} | {mean(gs):.3f} | {mean(drops):.4f} | "
            f"{mean(shares):.2%} | {mean(moves):.2e} | {mean(moves) / module.lower_lr:.3f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
