"""The planner's output: the ranked table, the gin bindings of the best layouts, and the
predicted-against-compiled table of `--verify`."""
from __future__ import annotations

from jaxtrain.planner.planner import Evaluation
from jaxtrain.training.plan_keys import BY_NAME

GIB = 2 ** 30


def ranked_table(ranked: list[Evaluation], top: int) -> str:
    """Per device, GiB: parameters, optimizer state (+ host), gradients, saved activations, all
    temporaries, the peak and the claim (peak + margin); then time."""
    head = (f"{'#':>3}  {'layout':<62} {'remat':<13} {'params':>6} {'optim':>6} {'grads':>6} {'acts':>6} "
            f"{'temp':>6} {'peak':>6} {'claim':>6} {'fits':>4} {'step s':>7} {'tok/s/dev':>9} {'MFU':>5}  exposed comm")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(ranked[:top], 1):
        m, t = e.memory, e.time
        exposed = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in sorted(t.by_kind.items(), key=lambda kv: -kv[1])
                            if k in ("tensor", "experts", "pipeline", "host") and v >= 5e-4)
        if t.bubble:
            exposed = ", ".join(filter(None, [exposed, f"bubble {1e3 * t.bubble:.0f} ms"]))
        if t.hidden_comm > t.compute:
            exposed = ", ".join(filter(None, [exposed, f"unhidden {1e3 * (t.hidden_comm - t.compute):.0f} ms"]))
        layout, remat = e.candidate.label(omit=("remat",)), _remat(e)
        optimizer = f"{m.optimizer / GIB:.1f}"
        if m.optimizer_host:
            optimizer = f"{m.optimizer_host / GIB:.0f}h"  # in host memory
        lines.append(f"{i:>3}  {layout:<62} {remat:<13} {m.params / GIB:>6.1f} {optimizer:>6} "
                     f"{m.gradients / GIB:>6.1f} {m.saved_activations / GIB:>6.1f} {m.temp / GIB:>6.1f} "
                     f"{m.peak / GIB:>6.1f} {e.claimed_bytes / GIB:>6.1f} {'yes' if e.fits else 'no':>4} "
                     f"{t.total:>7.3f} {e.tokens_per_sec_per_device:>9.0f} {100 * e.mfu:>4.0f}%  {exposed or '-'}")
    return "\n".join(lines)


def _remat(e: Evaluation) -> str:
    return BY_NAME["remat"].format(e.candidate.remat)  # "model": the model config's own


def gin_bindings(e: Evaluation) -> str:
    """What to put in a gin file (or pass as --gin_param) to run this layout: its whole plan,
    the remat policy included."""
    return f'Experiment.layout = "{e.candidate.spec()}"'


def verify_table(verified: list) -> str:
    """verify.Verified rows: predicted (for the compiling platform) against compiled memory, and
    whether each layout holds the memory it claims."""
    head = (f"{'layout':<62} {'remat':<13} {'args pred':>9} {'args XLA':>9} {'err':>6} {'temp pred':>9} "
            f"{'temp XLA':>9} {'err':>6} {'peak XLA':>8} {'claim':>7}  verdict")
    lines = [head, "-" * len(head)]
    for v in verified:
        e, predicted, compiled = v.evaluation, v.predicted, v.compiled
        layout, remat = e.candidate.label(omit=("remat",)), _remat(e)
        if "error" in compiled:
            lines.append(f"{layout:<62} {remat:<13} {v.verdict()}")
            continue
        args, temp = compiled["argument_gb"], compiled["temp_gb"]
        note = "; XLA replicated a value it could not reshard" if compiled.get("involuntary_remat") else ""
        lines.append(
            f"{layout:<62} {remat:<13} {predicted.arguments / GIB:>9.2f} {args:>9.2f} "
            f"{predicted.arguments / GIB / args - 1:>+6.1%} {predicted.temp / GIB:>9.2f} {temp:>9.2f} "
            f"{predicted.temp / GIB / temp - 1:>+6.1%} {v.peak_gb:>8.2f} {v.claim_gb:>7.2f}  "
            f"{v.verdict() if v.holds_claim else v.verdict() + ', ranked last'}{note}")
    return "\n".join(lines)
