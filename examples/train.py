"""Train a small long-context MoE language model with context parallelism on the block.

    python -m examples.train model=tiny mesh=cpu_8 ici_context_parallelism=4 \\
        per_device_batch_size=0.25 max_target_length=2048 train.steps=20

(or `moe-train ...`, the same from any directory after pip install "moe-cp[examples]").

One Hydra app on this project's config tree (`conf/train.yaml`: every selector setting,
MaxText spelling, plus a `train:` node). The selector checks the config first: a config
it rejects stops with its findings and exit 1 before anything is compiled. Then the
model is created sharded, trained with optax AdamW on a Markov language whose loss
floor is known (examples/data.py), with a progress bar and a per-step log (loss,
load-balance loss, dropped fraction, tokens/s), and the run's JSON and a PNG of its loss
curves are written to Hydra's output folder.

Importable too: `setup(config, settings, mesh)` and `Trainer.step()` are what the
tests and bench.train_memory use.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

import selector
from checks.jax_start import quiet_jax_start
from selector.compose import schema_node
from selector.config import Config
from selector.report import render_text


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 20
    learning_rate: float = 3e-3
    seed: int = 0  # initial weights
    data_seed: int = 0  # the Markov language and the batches
    vocab: int = 64
    layers: int = 2
    heads: int = 4
    load_balance_loss_weight: float = 0.01  # MaxText's name; the balance loss in the objective
    plot: bool = True


@dataclass(frozen=True)
class TrainConfig(Config):
    """The selector's settings plus the training ones (the `train:` node)."""

    train: TrainSettings = field(default_factory=TrainSettings)


def register() -> None:
    ConfigStore.instance().store(name="train_schema", node=schema_node(TrainConfig))


def split(cfg) -> tuple[Config, TrainSettings]:
    """(the selector's typed Config, the training settings) from the composed config."""
    settings = TrainSettings(**OmegaConf.to_container(cfg.train))
    rest = {k: cfg[k] for k in cfg if k != "train"}
    return selector.to_config(rest), settings


@dataclass
class Trainer:
    """A built model and its jitted step; `step(i)` trains on batch i and returns its
    metrics (floats)."""

    model: object
    params: object
    rest: object
    opt_state: object
    step_fn: object
    language: object
    token_sharding: object
    batch: int
    seq: int
    seed: int

    def step(self, i: int) -> dict:
        import jax

        tokens = self.language.batch(i, self.batch, self.seq, self.seed)
        inputs, targets = (
            jax.device_put(t, self.token_sharding) for t in (tokens[:, :-1], tokens[:, 1:])
        )
        start = time.perf_counter()
        self.params, self.opt_state, metrics = self.step_fn(
            self.params, self.opt_state, self.rest, inputs, targets
        )
        metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
        metrics["tokens_per_s"] = self.batch * self.seq / (time.perf_counter() - start)
        return metrics


def setup(config: Config, settings: TrainSettings, mesh) -> Trainer:
    """Resolve the plan on the live mesh, create the model and optimizer state sharded,
    and jit the step (the step compiles once; later steps reuse it)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from examples.data import MarkovLanguage
    from examples.lm import MoELanguageModel

    plan = selector.resolve(config, mesh)
    model = MoELanguageModel(
        config,
        plan,
        mesh,
        vocab=settings.vocab,
        layers_=settings.layers,
        heads=settings.heads,
        rngs=nnx.Rngs(settings.seed),
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optax.adamw(settings.learning_rate)
    # Optimizer state created in its shardings: each moment rests like its parameter,
    # anything else (the step count) replicated; no device holds a full replica.
    replicated = model.layout.named(P())
    opt_shardings = optax.tree_map_params(
        optimizer,
        lambda _, p: p.sharding,
        jax.eval_shape(optimizer.init, params),
        params,
        transform_non_params=lambda _: replicated,
    )
    opt_state = jax.jit(optimizer.init, out_shardings=opt_shardings)(params)
    lb_weight = settings.load_balance_loss_weight

    def loss_fn(params, rest, inputs, targets):
        lm = nnx.merge(graphdef, params, rest)
        logits, stats = lm(inputs)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        lb = jnp.mean(jnp.stack([s["load_balance_loss"] for s in stats]))
        dropped = jnp.mean(jnp.stack([s["dropped_fraction"] for s in stats]))
        return ce + lb_weight * lb, {"loss": ce, "load_balance_loss": lb, "dropped": dropped}

    def train_step(params, opt_state, rest, inputs, targets):
        grads, metrics = jax.grad(loss_fn, has_aux=True)(params, rest, inputs, targets)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    lay = model.layout
    token_sharding = lay.named(P(*lay.x_BSM[:2]))
    dev = plan.per_device

    def shardings(tree):
        return jax.tree.map(lambda a: a.sharding, tree)

    # The step hands back parameters and optimizer state in exactly the shardings they
    # came in (their at-rest ones), so the next step finds its compiled program.
    step_fn = jax.jit(
        train_step,
        in_shardings=(
            shardings(params),
            shardings(opt_state),
            shardings(rest),
            token_sharding,
            token_sharding,
        ),
        out_shardings=(shardings(params), shardings(opt_state), lay.named(P())),
        donate_argnums=(0, 1),
    )
    return Trainer(
        model=model,
        params=params,
        rest=rest,
        opt_state=opt_state,
        step_fn=step_fn,
        language=MarkovLanguage(settings.vocab, settings.data_seed),
        token_sharding=token_sharding,
        batch=round(dev.global_batch),
        seq=dev.seq_len,
        seed=settings.data_seed,
    )


def write_outputs(out: Path, config: Config, settings, plan, history, floor: float) -> list:
    """The run's JSON and a PNG of its loss curves."""
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "settings": asdict(settings),
        "plan": plan.as_dict(),
        "loss_floor": floor,
        "steps": history,
    }
    paths = [out / "run.json"]
    paths[0].write_text(json.dumps(payload, indent=1, default=str))  # the record first
    if not settings.plot:
        return paths
    try:
        import matplotlib
    except ImportError:
        print(
            "skipped loss.png: matplotlib is not installed (pip install matplotlib); "
            f"the run's record is in {paths[0]}",
            file=sys.stderr,
        )
        return paths
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 4))
    steps = range(1, len(history) + 1)
    (ce,) = ax.plot(steps, [h["loss"] for h in history], "o-", label="cross-entropy (nats)")
    floor_line = ax.axhline(floor, color="gray", ls=":", label=f"loss floor {floor:.3f} nats")
    ax.set(xlabel="step", ylabel="cross-entropy, nats", title=f"{config.model_name}, cp={plan.cp}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    # The balance loss is a different quantity (about 1 when balanced): its own axis.
    right = ax.twinx()
    (lb,) = right.plot(
        steps,
        [h["load_balance_loss"] for h in history],
        "s--",
        color="tab:orange",
        label="load-balance loss (right)",
    )
    right.set_ylabel("load-balance loss (1 = balanced)")
    ax.legend(handles=[ce, floor_line, lb], loc="upper right", fontsize=8)
    fig.savefig(out / "loss.png", dpi=110, bbox_inches="tight")
    paths.append(out / "loss.png")
    return paths


def run(cfg) -> int:
    config, settings = split(cfg)
    plan, findings = selector.api.analyse_any(config)
    if plan is None or selector.findings.errors_in(findings):
        print(render_text(config, plan, findings))
        print("\nerror: the selector rejects this config; nothing was compiled.", file=sys.stderr)
        return 1
    quiet_jax_start()  # before jax: no compiler-plugin start-up noise without accelerators
    if config.hardware.platform == "cpu" and "jax" not in sys.modules:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = (
            f"{flags} --xla_force_host_platform_device_count={plan.mesh.num_devices}".strip()
        )
    from tqdm import tqdm

    import layers

    mesh = layers.mesh_for_plan(plan)
    trainer = setup(config, settings, mesh)
    history = []
    bar = tqdm(range(settings.steps), desc=f"train cp={plan.cp}", unit="step")
    for i in bar:
        m = trainer.step(i)
        history.append(m)
        bar.set_postfix(loss=f"{m['loss']:.3f}", lb=f"{m['load_balance_loss']:.3f}")
        tqdm.write(
            f"step {i + 1:4d}  loss {m['loss']:.4f}  load-balance {m['load_balance_loss']:.4f}  "
            f"dropped {m['dropped']:.2%}  {m['tokens_per_s']:,.0f} tokens/s"
        )
    out = Path(HydraConfig.get().runtime.output_dir)
    paths = write_outputs(out, config, settings, plan, history, trainer.language.floor)
    print(
        f"loss {history[0]['loss']:.3f} -> {history[-1]['loss']:.3f} (floor "
        f"{trainer.language.floor:.3f}); wrote {', '.join(map(str, paths))}"
    )
    return 0


def override_problem(argv: list[str]) -> str | None:
    """One paragraph for the first command-line override this app cannot take, or None:
    a key that is no setting (with the closest ones, `train.` included: `steps` is
    `train.steps`), a `+key` for a key that exists, or a deletion."""
    from selector.compose import close_keys, valid_keys

    train_keys = [f"train.{f}" for f in TrainSettings.__dataclass_fields__]
    keys = [*valid_keys(), "train", *train_keys]
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue
        key = arg.split("=", 1)[0]
        bare = key.lstrip("+~")
        if bare.startswith(("hydra.", "hydra/")):
            continue
        if key.startswith("~"):
            return f"{arg!r} deletes a setting; every setting needs a value: set it instead."
        if bare not in keys:
            close = close_keys(bare, choices=keys)
            if f"train.{bare}" in train_keys:
                close = [f"train.{bare}", *[c for c in close if c != f"train.{bare}"]]
            hint = f" Did you mean {' or '.join(close)}?" if close else ""
            return (
                f"Unknown setting {bare!r} in {arg!r}.{hint} The training settings live "
                f"under train. ({', '.join(train_keys)}); the rest use MaxText's spelling "
                "(python -m selector --cfg job lists them)."
            )
        if key.startswith("+"):
            return f"{bare!r} is already a setting and '+' adds a new key: write {arg.lstrip('+')}."
    return None


def compose_problem(argv: list[str]) -> str | None:
    """One paragraph when the overrides do not compose into this app's config (a value
    of the wrong type, a number past any size, a value nested past the recursion
    limit), checked before Hydra runs the app (whose own report is a traceback for the
    last two). Sweeps (-m) are left to Hydra."""
    if any(a in ("-m", "--multirun") for a in argv):
        return None
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from selector.findings import shown

    lines = [a for a in argv if not a.startswith("-") and not a.startswith("hydra")]
    register()
    try:
        with initialize_config_dir(str(selector.conf_dir()), version_base=None):
            compose("train", overrides=lines)
    except RecursionError:
        return (
            "an override nests its value deeper than the config reader follows; give a plain value."
        )
    except Exception as exc:  # noqa: BLE001 - reported as one paragraph, exit 2
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"Cannot apply the overrides: {shown(first, 300)}. Give each setting a value of its type."
    finally:
        GlobalHydra.instance().clear()
    return None


def main() -> None:
    problem = override_problem(sys.argv[1:]) or compose_problem(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    register()
    status = {"code": 0}

    @hydra.main(version_base=None, config_path=str(selector.conf_dir()), config_name="train")
    def app(cfg) -> None:
        status["code"] = run(cfg)

    app()
    sys.exit(status["code"])


def entry() -> None:
    """Console script `moe-train` (pip install "moe-cp[examples]"): the same as
    `python -m examples.train`, from any directory."""
    main()


if __name__ == "__main__":
    main()
