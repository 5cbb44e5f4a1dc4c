"""Measured-cost speedup (design §3): the paper's formula counts decoder layers only; this one counts seconds.

On the machine at hand we time, each after warm-up as the median of `repeats` runs (with device syncs around
the timers on CUDA):
- stage_s[s]: pipeline stage s decoding one token against a KV cache that holds `context` tokens;
- head_s:     the target head (final norm + full-vocabulary LM head) on one hidden row;
- module_s:   one steady-state draft: `ModuleDrafter.draft` on the schedule's full step (n tokens in
              flight), exactly the call `PipelineDecoder.generate` makes, plus choosing the draft token from it
              (argmax, or warp + sample when T > 0), since that token must exist before the next step;
- verify_s:   `verify_greedy` (T = 0), or warping the target's logits + `verify_sampled` (T > 0).

Cost model:
- plain AR, per token:  T_ar = Σ_s stage_s + head. The embedding lookup is a row gather, negligible next to
  any decoder layer, and is left out of both sides.
- SPD, one device per stage: in every step all stages run concurrently, the last one also runs the head and
  verifies, and the module drafts concurrently with the step (paper §3), so
      T_step = max(max_{s<n} stage_s, stage_n + head + verify, module).
  Communication between devices (sending a [1, d] hidden row per stage per step) is not modelled.
  PPSD and the output-state ablation draft from the step's outputs, after it:
      T_step = max(max_{s<n} stage_s, stage_n + head + verify) + module.
- W > 1 (SPD's pipeline trees, `width=`): a steady tree step runs a level of W rows in every stage but the last
  two (`tree_rows`: the exiting node and its kept child are one row each), the module drafts for the W tips in one
  batched pass, and verification is one draw of p over a node's children; AR is still priced on one row a stage.
- A step settles α = N/K tokens on average, so speedup_measured = α · T_ar / T_step, while the layer-count
  formula gives n · α (they agree when the stages are equal and head, module and verification cost nothing).
- EAGLE-3's chain (no pipeline, `calibrate_chain`): a cycle is m draft passes (`Eagle3Drafter.draft`, head and
  choice included), one target forward over the newest token and the m drafts with the head on all m + 1 rows and
  each row verified, then the drafter's update over the verified rows (timed for one row: at τ ≈ 1-2 a pass
  over two rows costs what one does). A cycle settles τ tokens, so speedup_measured = τ · T_ar / T_cycle.
  W > 1 (EAGLE-3's dynamic tree): the same terms with the tree's draft passes (one per depth, W rows each) and
  one target forward over its `tree_nodes` + 1 rows under the tree mask, every level of its deepest path settled:
  on a CPU more rows are not free (design §9), and the measured-cost speedup charges them.
- Rows that vary by step (FlowSpec's segments, PipeDec's levels; `calibrate_rows`): every step is priced by the rows
  each stage ran in it (`DecodeStats.step_rows`, a histogram over the run), with one device per stage:
      T_step = max(max_{s<n} stage_s(r_s), stage_n(r_n) + head(r_n) + r_n · verify, draft side),
  an idle stage costing nothing. The draft side runs beside the stages on a device of its own: PipeDec's draft
  model over the r_1 tips that entered (its layers, head and top-c; the paper's first stage), FlowSpec's tree growth
  on its controller (one growth, timed on a real context, charged to every step: an upper bound, growth follows
  only a walk that verified something). speedup_measured = α · T_ar / mean T_step; the layer-count formula stays
  n · α (the stages' layers set every step; rows and the draft side cost no layers).
"""

from __future__ import annotations

import dataclasses

import torch

from spd.drafters.base import Cycle, StepView, propose_level
from spd.drafters.spd_module import ModuleDrafter
from spd.layout import needed_layers
from spd.engine import build_decoder
from spd.methods import CHAIN
from spd.models.module import SpeculationModule
from spd.runtime.schedule import spd_step
from spd.runtime.views import step_view
from spd.verify.sampling import (Proposal, SamplingParams, greedy_token, propose, propose_children, settle,
                          settle_children)
from spd.targets.stages import StagedTarget
from spd.targets.timing import median_seconds

LAST = "last stage + head + verify"


# ---------------------------------------------------------------- the cost model
def ar_token_time(stage_s: list[float], head_s: float) -> float:
    """Seconds per token of plain AR decoding: every layer, then the head."""
    return sum(stage_s) + head_s


def step_time(stage_s: list[float], head_s: float, verify_s: float, module_s: float,
              after_step: bool = False, hosted: bool = False) -> tuple[float, str]:
    """Seconds per pipelined step with one device per stage, and which term sets it. hosted: the controller runs
    stage 1 in its process (runtime=distributed controller=first_stage), so stage 1, the module and the
    verification take turns there."""
    terms = {f"stage {s + 1}": t for s, t in enumerate(stage_s[:-1])}
    if hosted:
        terms["last stage + head"] = stage_s[-1] + head_s
    else:
        terms[LAST] = stage_s[-1] + head_s + verify_s
    if hosted and not after_step:
        terms["stage 1 + module"] = terms.pop("stage 1") + module_s + verify_s
    elif not after_step:
        terms["module"] = module_s
    bottleneck = max(terms, key=terms.get)  # ties: the earliest term in pipeline order
    if after_step:
        return terms[bottleneck] + module_s, f"{bottleneck}, then the module"
    return terms[bottleneck], bottleneck


def measured_cost_speedup(alpha: float, calibration: dict) -> float:
    """α tokens per step, each step costing step_s instead of ar_token_s per token."""
    return alpha * calibration["ar_token_s"] / calibration["step_s"]


def chain_measured_cost_speedup(tau: float, calibration: dict) -> float:
    """τ tokens per chain cycle, each cycle costing cycle_s instead of ar_token_s per token."""
    return tau * calibration["ar_token_s"] / calibration["cycle_s"]


def formula_speedup(alpha: float, n: int, after_step: bool = False, num_layers: int = 1,
                    module_layers: int = 0) -> float:
    """The paper's layer-count speedup: L′acc = n·α for SPD; L′acc·L/(L_s·n + L) when the module drafts after
    each step (PPSD, the output-state ablation), whose L_s layers then add to every step's L/n."""
    eal = n * alpha
    return eal * num_layers / (module_layers * n + num_layers) if after_step else eal


def tree_rows(n: int, width: int) -> list[int]:
    """Rows each stage runs in a steady tree step: the last two stages run the exiting node and its kept child
    (one each), the others a level of W nodes."""
    return [width if s < n - 2 else 1 for s in range(n)]


def _siblings(rows: int, context: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The mask of `rows` sibling rows at position `context`: each sees the cache and itself ([rows, context + rows]
    visible, key positions [context + rows])."""
    visible = torch.cat([torch.ones(rows, context, dtype=torch.bool), torch.eye(rows, dtype=torch.bool)], 1)
    keys = torch.cat([torch.arange(context), torch.full((rows,), context)])
    return visible.to(device), keys.to(device)


def _stage_rows(staged: StagedTarget, s: int, stage_in: torch.Tensor, rows: int, context: int, cache):
    """Stage s over `rows` copies of one new row at position `context`, siblings in a tree level."""
    if rows == 1:
        return staged.run_stage(s, stage_in, torch.tensor([context], device=stage_in.device), cache)
    device = stage_in.device
    return staged.run_layers(stage_in.expand(1, rows, -1), torch.full((rows,), context, device=device),
                             staged.bounds[s], staged.bounds[s + 1], cache, visible=_siblings(rows, context, device))


def _prefilled(staged: StagedTarget, context: int, capture: frozenset, generator: torch.Generator):
    """Random ids [1, context + 2], and a cache of their first `context` after one prefill over context + 1 of them
    (the new token at position `context` has its stage inputs in the captured states)."""
    ids = torch.randint(staged.config.vocab_size, (1, context + 2), generator=generator, device=staged.device)
    cache = staged.new_cache()
    final, hidden = staged.forward_all(ids, cache, 0, capture)
    cache.crop(context)
    return ids, cache, final, hidden


@torch.no_grad()
def calibrate(staged: StagedTarget, module: SpeculationModule, params: SamplingParams,
              context: int = 128, repeats: int = 20, width: int = 1) -> dict:
    """Time each term of the cost model on this machine (see the module docstring). width: W, a tree step's
    rows per stage (`tree_rows`) and one draft per branch tip."""
    n, device = staged.n, staged.device
    if context < n:
        raise ValueError(f"context={context} must hold at least n={n} tokens to fill the pipeline")
    generator = torch.Generator(device=device).manual_seed(0)
    # One prefill over context + 1 tokens gives the cache (cropped back to `context`), the stage inputs of the
    # new token at position `context`, and every hidden state the module's rows read.
    ids, cache, final, hidden = _prefilled(staged, context, frozenset(needed_layers(staged.bounds)) | set(staged.bounds),
                                           generator)

    def time_stages(rows: list[int]) -> list[float]:
        out = []
        for s in range(n):
            stage_in = hidden[staged.bounds[s]][:, context: context + 1]     # [1, 1, d] H^{b_s} of the new token
            out.append(median_seconds(lambda: _stage_rows(staged, s, stage_in, rows[s], context, cache), repeats,
                                       device, reset=lambda: cache.crop(context)))  # the context length stays fixed
        return out

    rows = tree_rows(n, width)
    one_row_s = time_stages([1] * n)                       # what plain AR pays per stage
    stage_s = one_row_s if width == 1 else time_stages(rows)

    last_row = final[0, -1]                                                  # [d] H^L of the new token
    head_s = median_seconds(lambda: staged.logits(last_row), repeats, device)

    # Steady state: positions 0..context-n are final (depth n), the n newest are in flight at depths n-1..0
    # (one deeper each when the module drafts after the step).
    drafter = ModuleDrafter(module)
    after = module.plan.after_step
    steady = spd_step(context, n, n)
    done = steady.in_flight()[0][0]
    drafter.start({layer: h[:, :done] for layer, h in hidden.items()}, ids[0, :done].tolist())
    # [1, 1, d] each: only the layers a token at depth k has already passed
    features = {pos: {layer: h[:, pos: pos + 1] for layer, h in hidden.items()
                      if layer <= staged.bounds[min(n, k + after)]}
                for pos, k in steady.in_flight()}
    view = step_view(steady, ids[0].tolist(), features, after=after)

    def draft() -> Proposal:
        return drafter.propose(view, lambda logits: propose(logits, params, generator))   # the runtime's own draft

    # W > 1: W branches whose in-flight rows are all distinct (the most rows a level's batched pass can read)
    branches = [StepView(view.t, view.occupancy, view.n,
                         tuple(dataclasses.replace(item, node=b * (context + 1) + item.pos) for item in view.in_flight))
                for b in range(width)]

    def draft_tips() -> list:             # every tip of the level drafts its W children, in one batched pass
        return propose_level(drafter, branches, lambda logits: propose_children(logits, width))

    module_s = median_seconds(draft if width == 1 else draft_tips, repeats, device)

    target_logits = staged.logits(last_row)                                  # [V]
    if width == 1:
        token, q, _ = draft()
        verify_s = median_seconds(lambda: settle(target_logits, token, q, params, generator), repeats, device)
    else:
        children = [child for child, _ in draft_tips()[0]]
        verify_s = median_seconds(lambda: settle_children(target_logits, children, params, generator), repeats,
                                   device)

    step_s, bottleneck = step_time(stage_s, head_s, verify_s, module_s, after)
    return {"stage_s": stage_s, "head_s": head_s, "module_s": module_s, "verify_s": verify_s,
            "ar_token_s": ar_token_time(one_row_s, head_s), "step_s": step_s, "bottleneck": bottleneck,
            "W": width, "rows": rows, "ar_stage_s": one_row_s, "context": context, "repeats": repeats, "device": str(device), "dtype": str(staged.dtype)}


@torch.no_grad()
def calibrate_chain(staged: StagedTarget, drafter, params: SamplingParams, m: int, context: int = 128,
                    repeats: int = 20, width: int = 1, budget: int | None = None) -> dict:
    """Time each term of EAGLE-3's cycle (see the module docstring) with `drafter` (an Eagle3Drafter) on the
    unsplit target, against a cache of `context` tokens; W > 1: its tree of `budget` nodes, drafted and verified
    under the tree mask (a cycle's price grows with the rows it feeds)."""
    device = staged.device
    generator = torch.Generator(device=device).manual_seed(0)
    capture = frozenset(drafter.layers_needed())
    ids = torch.randint(staged.config.vocab_size, (1, context + 2), generator=generator, device=device)
    cache = staged.new_cache()
    _, captured = staged.forward_all(ids[:, :context], cache, 0, capture)
    drafter.start(captured, ids[0, : context + 1].tolist())
    rewind = lambda: cache.crop(context)  # noqa: E731  (keep the context length fixed between repeats)

    def ar_token() -> int:
        out, _ = staged.forward_all(ids[:, context: context + 1], cache, context)
        return propose(staged.logits(out[0, -1]), params, generator).token

    ar_token_s = median_seconds(ar_token, repeats, device, reset=rewind)
    decoder = build_decoder(CHAIN, staged, frozenset(), drafter, width=width, draft_length=m, tree_nodes=budget)
    choose = lambda logits: propose(logits, params, generator)          # noqa: E731
    trees = []
    drafts_s = median_seconds(
        lambda: trees.append(drafter.propose(Cycle(int(ids[0, context]), m, width, decoder.budget), choose)),
        repeats, device)
    tree = trees[-1]

    def verify() -> dict:
        logits, hidden = decoder.forward_tree(tree, cache, context)       # [rows, V]
        node = 0
        while tree.children(node):                # the deepest walk: every level settled, as when all hold
            children = tree.children(node)
            settle_children(logits[node], [tree.proposals[c - 1] for c in children], params, generator)
            node = children[0]
        propose(logits[node], params, generator)                           # the token after the last node
        return hidden

    verify_s = median_seconds(verify, repeats, device, reset=rewind)
    hidden = verify()
    rewind()
    update_s = median_seconds(
        lambda: drafter.observe({layer: h[:, :1] for layer, h in hidden.items()}, ids[0, : context + 2].tolist()),
        repeats, device, reset=lambda: drafter.rewind(context))
    cycle_s = drafts_s + verify_s + update_s
    return {"ar_token_s": ar_token_s, "drafts_s": drafts_s, "verify_s": verify_s, "update_s": update_s,
            "cycle_s": cycle_s, "m": m, "W": width, "rows": len(tree), "context": context, "repeats": repeats, "device": str(device),
            "dtype": str(staged.dtype)}


# ------------------------------------------------ rows that vary by step (FlowSpec's segments, PipeDec's levels)
def rows_of(key: str) -> tuple[int, ...]:
    """A step_rows key "r1,...,rn" -> the rows each stage ran."""
    return tuple(int(r) for r in key.split(","))


def priced_step(rows: tuple[int, ...], costs: dict) -> float:
    """One step's seconds under the rows cost model (module docstring), from `calibrate_rows`' timings."""
    terms = [costs["stage_s"][str(r)][s] if r else 0.0 for s, r in enumerate(rows)]
    if rows[-1]:
        terms[-1] += costs["head_s"][str(rows[-1])] + rows[-1] * costs["verify_s"]
    draft = costs["draft_s"]
    terms.append(draft.get(str(rows[0]), 0.0) if isinstance(draft, dict) else draft)
    return max(terms)


def rows_measured_cost_speedup(alpha: float, step_rows: dict[str, int], costs: dict) -> float:
    """α tokens per step, the steps priced one by one by their rows (step_rows: "r1,...,rn" -> steps)."""
    steps = sum(step_rows.values())
    mean_step = sum(count * priced_step(rows_of(key), costs) for key, count in step_rows.items()) / steps
    return alpha * costs["ar_token_s"] / mean_step


@torch.no_grad()
def calibrate_rows(staged: StagedTarget, params: SamplingParams, step_rows: dict[str, int], *, draft_model=None,
                   children: int = 1, grow=None, context: int = 128, repeats: int = 20) -> dict:
    """Time every term `priced_step` needs for the steps in step_rows: each stage at each row count it ran, the
    head over each count of exiting rows, one node's verification, and the draft side — draft_model (a
    `spd.drafters.draft_model.DraftLM`, PipeDec) over each count of tips with its top-`children`, or grow() (one
    tree of FlowSpec's drafter, started on a real context by the caller)."""
    n, device = staged.n, staged.device
    generator = torch.Generator(device=device).manual_seed(0)
    ids, cache, final, hidden = _prefilled(staged, context, frozenset(staged.bounds), generator)
    counts = [sorted({rows_of(key)[s] for key in step_rows} - {0} | {1}) for s in range(n)]   # 1: what AR pays
    stage_s: dict[str, list[float | None]] = {}
    for s in range(n):
        stage_in = hidden[staged.bounds[s]][:, context: context + 1]          # [1, 1, d] H^{b_s} of the new token
        for r in counts[s]:
            stage_s.setdefault(str(r), [None] * n)[s] = median_seconds(
                lambda: _stage_rows(staged, s, stage_in, r, context, cache), repeats, device,
                reset=lambda: cache.crop(context))
    last_row = final[0, -1:]                                                  # [1, d] H^L of the new token
    head_s = {str(r): median_seconds(lambda: staged.logits(last_row.expand(r, -1)), repeats, device)
              for r in counts[-1]}
    target_logits = staged.logits(last_row[0])                                # [V]
    verify_s = median_seconds(lambda: settle_children(target_logits, [Proposal(0)], params, generator), repeats,
                              device)
    if draft_model is not None:
        draft_cache = draft_model.new_cache()
        draft_model(ids[:, :context], torch.arange(context, device=device), draft_cache)

        def draft_tips(r: int):
            logits = draft_model(ids[:, context: context + 1].expand(1, r), torch.full((r,), context, device=device),
                                 draft_cache, _siblings(r, context, device))
            return [propose_children(row, children) for row in logits]

        draft_s: dict[str, float] | float = {
            str(r): median_seconds(lambda: draft_tips(r), repeats, device, reset=lambda: draft_cache.crop(context))
            for r in counts[0]}
    else:
        draft_s = median_seconds(grow, repeats, device) if grow is not None else 0.0
    ar_token_s = ar_token_time([stage_s["1"][s] for s in range(n)], head_s["1"])
    return {"rows_priced": True, "stage_s": stage_s, "head_s": head_s, "verify_s": verify_s, "draft_s": draft_s,
            "ar_token_s": ar_token_s, "context": context, "repeats": repeats, "device": str(device),
            "dtype": str(staged.dtype)}


def grow_timer(drafter, context_ids: list[int], depth: int, width: int, budget: int):
    """FlowSpec's draft side for `calibrate_rows`: its drafter started on context_ids (a real decode: the context's
    statistics cost what they find), growing one tree from the last token."""
    drafter.start({}, list(context_ids))
    return lambda: drafter.propose(Cycle(context_ids[-1], depth, width, budget),
                                   lambda logits: Proposal(greedy_token(logits)))


def rows_calibration(session, step_rows: dict[str, int], context_ids: list[int], repeats: int = 20) -> dict:
    """`calibrate_rows` for an open session's method: PipeDec's draft model, or FlowSpec's tree growth on
    context_ids (a prompt and its decode)."""
    grow, spec, tree = None, session.spec, session.spec.tree
    if session.draft_model is None:
        grow = grow_timer(session.drafter(), context_ids, spec.draft_length, tree.width, tree.nodes)
    return calibrate_rows(session.staged, session.params, step_rows, draft_model=session.draft_model,
                          children=tree.children or tree.width, grow=grow, repeats=repeats)
