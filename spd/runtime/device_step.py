"""A draft-then-verify cycle as one function of device tensors with fixed shapes (gpt-fast's static cache, SGLang's
on-device acceptance): the target's forward over the newest verified token and its drafts (a chain, or a tree under
its ancestor mask), the target's own choice after every row (greedy, or the keyed Gumbel-max draw), acceptance as
the deepest draft whose every ancestor equals the choice after its parent (spd.verify.accept, the host loop's rule
too), the accepted path's cache rows moved
down to contiguous slots, and the next cycle's inputs written in place. A drafter that runs on the device (EAGLE-3's
module, spd.drafters.eagle3_device) updates and drafts inside the same step. No drafts is plain AR.

Nothing inside the step is read back to the host: the rollback is the position tensor itself (the static cache's
rows past a query's position are hidden by its mask and overwritten by the next step), so a step launches the same
kernels on the same memory every time, which `torch.compile(fullgraph=True)` compiles whole and a CUDA graph can
replay. The decoder around it (spd.runtime.device_chain) reads one thing a cycle, the verified tokens and their
count, as one copy into a host buffer (pinned on CUDA) — which a context drafter needs on the host anyway."""

from __future__ import annotations

import torch

from spd.drafters.base import DeviceVerified
from spd.verify.accept import kept_drafts, kept_path
from spd.verify.device_sampling import DeviceSampling, choose, gumbel
from spd.verify.sampling import SamplingParams
from spd.targets.fixed_step import WARMUP_RUNS
from spd.targets.linears import plain_products, swapped_linears
from spd.targets.stages import StagedTarget


BUCKET = 512     # positions: a static cache's length is a multiple of this
ROWS = (1, 2, 4, 8, 16, 32)   # rows a step runs: a cycle's drafts are padded up to the next of these


class StepState:
    """What every step of one cache shares, in device tensors: `tokens` [R] (the root, then its drafts), `drafts` []
    (how many of tokens[1:] are real; the rest are padding that is never kept), `position` [] (the root's position),
    a tree's `depth` [R], `parent` [R] and `ancestors` [R, R] (row i sees row j: j is i or above it), `key` []
    (sampling: the request's key; a row at depth d chooses position root + 1 + d with that position's keyed noise,
    computed inside the step), `out` [R + 2] (what the host reads: the count c
    of verified tokens, the target's margin where it chose the last of them, the verified tokens; float64 holds
    token ids exactly). side: a drafter's side rows (Self-Draft's branches, spd.drafters.selfdraft_device), S more
    rows after the tree's R (tokens, depth, parent and ancestors are then [R + S]): each sees the root and the side
    rows its `visible` names, no tree row sees one; their argmaxes go out after the verified tokens
    (out[2 + R: 2 + R + S])."""

    def __init__(self, target: StagedTarget, cache, rows: int, params: SamplingParams, side=None):
        if not cache.static:
            raise ValueError("a device step needs a static cache (new_cache(max_length=...))")
        device = target.device
        self.cache, self.side, self.tree_rows = cache, side, rows
        self.sampling = DeviceSampling(target.device, params)
        tree = rows
        rows += side.rows if side is not None else 0
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)               # [R]
        self.drafts = torch.zeros((), dtype=torch.long, device=device)                 # []
        self.position = torch.zeros((), dtype=torch.long, device=device)               # []
        self.depth = torch.arange(rows, device=device)                                 # [R]
        self.parent = (torch.arange(rows, device=device) - 1).clamp(min=0)             # [R]
        self.ancestors = torch.ones(rows, rows, device=device).tril().bool()           # [R, R]
        self.out = torch.zeros(rows + 2, dtype=torch.float64, device=device)           # [R+2]
        self.mask_keys = torch.arange(cache.max_length, device=device).view(1, -1)     # [1, S]
        self.vocab = target.model.config.vocab_size
        self.key = torch.zeros((), dtype=torch.long, device=device)                    # []
        if side is not None:      # the side rows' shape never changes: set once (no parent: never a draft)
            self.depth[tree:].copy_(side.offsets())
            self.ancestors[tree:] = False
            self.ancestors[tree:, 0] = True
            self.ancestors[tree:, tree:] = side.visible()
            side.bind(self.tokens[tree:])

    def set_tree(self, tree, rows: int) -> None:
        """A context drafter's tree (spd.verify.tree.DraftTree, parents first) as the first `rows` rows' structure;
        padding rows sit at depth 0 under the root and see only themselves (never kept: they are not drafts)."""
        depths, parents = tree.depths(), [0, *tree.parents]
        pad = rows - len(tree)
        visible = torch.zeros(rows, rows, dtype=torch.bool)
        visible[: len(tree), : len(tree)] = tree.visibility()
        visible[len(tree):, len(tree):] = torch.eye(pad, dtype=torch.bool)
        device = self.tokens.device
        self.depth[:rows].copy_(torch.tensor(depths + [0] * pad), non_blocking=True)
        self.parent[:rows].copy_(torch.tensor(parents + [0] * pad), non_blocking=True)
        self.ancestors[:rows, :rows].copy_(visible.to(device), non_blocking=True)


class Graphed:
    """A step run eagerly, through torch.compile, or replayed as one CUDA graph — of the compiled step where both are
    asked for (SGLang's graph runner: Inductor generates the kernels, the suite's graph removes their launches).
    `body()` is the step as it runs (compiled or not), `mutable()` the tensors a step writes that the next one reads
    (restored after the warm-ups). Every bucket of a decoder captures into the decoder's one memory pool."""

    builds = 0   # steps run for the first time, every instance counted: what captures (CUDA) or compiles a step,
                 # so a benchmark can show that none happened while it timed

    def replay(self) -> torch.Tensor:
        """The body as one CUDA graph: captured on the first call (after warm-up runs on a side stream, which compile
        a compiled body and also advance the state: the capture's own run is undone by restoring it), then
        replayed."""
        if self.graph is None:
            device = self.target.device
            saved = [t.clone() for t in self.mutable()]
            with torch.cuda.device(device):
                side = torch.cuda.Stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    for _ in range(WARMUP_RUNS):
                        self.restore(saved)
                        self.body()
                torch.cuda.current_stream(device).wait_stream(side)
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=self.pool):
                    self.body()
            self.restore(saved)     # capturing ran nothing; the warm-ups' writes are undone here
        self.graph.replay()
        return self.out_buffer()

    def choose_runner(self, graph: bool, compile: str | None, pool=None) -> None:
        """self.run: the step eagerly, through torch.compile(fullgraph=True) with the `compile` backend (Inductor's
        default mode: its kernels, no graphs of its own), and replayed as a CUDA graph (`graph`) of whichever of the
        two it is. pool: the memory pool the graph captures into (torch.cuda.graph_pool_handle(), one a decoder)."""
        self.body, self.pool = self.step, pool
        if compile:
            # every step object (a bucket of a decoder) is its own cache entry on the one `step` code; past the
            # default limit of 8 a ninth would be a hard failure under fullgraph, so the limit follows the count
            limits = torch._dynamo.config
            limits.recompile_limit = max(limits.recompile_limit, 1024)
            limits.accumulated_recompile_limit = max(limits.accumulated_recompile_limit, 4096)
            compiled = torch.compile(self.step, fullgraph=True, dynamic=False, backend=compile,
                                     options=compile_options(compile, self.target.device))
            model = self.target.model
            swapped = swapped_linears(model)    # once: a walk of every module would cost each step

            def body():
                # the suite's own CPU products are an extension call the compiler cannot trace: F.linear inside
                with plain_products(model, swapped):
                    return compiled()
            self.body = body
            unchecked = unchecked_guards()

            def built():
                # a built step meets the same tensors of the same shapes every time, so only the guards that tell
                # the compiled steps apart are checked (all of them cost ~35 us a step on a CPU, a sixth of SPD's);
                # nothing is traced again (a step that would be fails loudly), so the products stay as they are
                # (swapping their classes costs ~3 us a module, ~50 us a step for the tiny 2-layer target)
                with unchecked:
                    return compiled()
        self.graph = None
        ready = self.replay if graph else self.body
        settled = built if compile and not graph else ready

        def first():
            Graphed.builds += 1
            self.run = settled
            return ready()
        self.run = first

    def restore(self, saved: list[torch.Tensor]) -> None:
        for tensor, value in zip(self.mutable(), saved):
            tensor.copy_(value)

    def out_buffer(self) -> torch.Tensor:
        return self.state.out



def unchecked_guards():
    """A reusable context in which torch.compile checks only the guards that tell its compiled entries apart
    (`skip_guard_eval_unsafe`): for a step that has run once, whose every later call meets the same tensors. Made
    once, as making one sets it at once (the earlier stance is put back here; each `with` sets it again)."""
    stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
    stance.__exit__(None, None, None)
    return stance


def compile_options(backend: str, device: torch.device) -> dict | None:
    """Inductor's options for a step on `device`. On a CPU every kernel launch is host work, and Inductor's default
    Python wrapper between the kernels costs as much again as they do on a small step: its C++ wrapper calls them
    from one compiled function (the EAGLE-3 chain's host time a token 984 -> 710 us, SPD's pipeline step 1,273 ->
    997 us, bench/overhead.py on 2 cores; compiling takes about twice as long). Greedy and sampled steps alike get
    vector kernels (the sampled draw's argmax is `first_max`'s, which Inductor vectorises right). On CUDA the step's
    graph replaces the wrapper."""
    if backend != "inductor" or device.type != "cpu":
        return None
    return {"cpp_wrapper": True}


class DeviceStep(Graphed):
    """One cycle over the first `rows` rows of the shared state: a chain (contiguous positions, causal), or a tree
    (`tree`: each row at the root's position + its depth, under its ancestors, the accepted path moved down).
    drafter: a DEVICE drafter (spd.drafters.base: `observe`, `propose`, tensors in, tensors out) that writes the
    next cycle's drafts into the buffers bound to it."""

    def __init__(self, target: StagedTarget, state: StepState, rows: int, compile: str | None = None,
                 cuda_graph: bool = False, tree: bool = False, drafter=None, pool=None):
        """compile: a torch.compile backend ("inductor"; "aot_eager" traces the same whole graph without generating
        code), None: eager. cuda_graph: on CUDA, the (compiled) step captured once as a CUDA graph, into `pool`, and
        replayed (elsewhere it runs eagerly, the twin the tests check)."""
        self.target, self.state = target, state
        self.tree, self.drafter, self.side = tree or state.side is not None, drafter, state.side
        self.capture = frozenset(drafter.layers_needed()) if drafter is not None else frozenset()
        device = target.device
        self.rows = torch.arange(rows, device=device)                                  # [r]
        # the rows the forward runs: the tree's first r, then the side rows after the state's R tree rows
        self.run_rows = self.rows if self.side is None else \
            torch.cat([self.rows, state.tree_rows + torch.arange(self.side.rows, device=device)])   # [r + S]
        self.span = torch.arange(len(self.run_rows), device=device)                    # [n] the cache slots'
        # a side row's parent, where a linear-attention layer reads its states: the nearest earlier side row it
        # sees, else the root (in the forward's row order; spd.targets.gated_delta's rule for trees)
        self.side_parents = None
        if self.side is not None:
            seen = self.side.visible().cpu()
            self.side_parents = torch.tensor([max((rows + j for j in range(k) if seen[k, j]), default=0)
                                              for k in range(self.side.rows)], device=device)   # [S]
        slots = state.cache.linear.slots
        if target.hybrid and len(self.run_rows) >= slots:
            raise ValueError(f"a step of {len(self.run_rows)} rows, but the cache's linear-attention layers keep "
                             f"{slots - 1} positions; allocate it with a larger rollback")
        self.choose_runner(cuda_graph and target.device.type == "cuda", compile, pool)

    def mutable(self) -> list[torch.Tensor]:
        """Not the caches: their rows past the position are hidden, and a warm-up's writes at or before it hold
        what the real step writes there."""
        state = self.state
        drafted = self.drafter.mutable() if self.drafter is not None else []
        drafted += self.side.mutable() if self.side is not None else []
        shape = [state.depth, state.parent, state.ancestors] if self.tree and self.drafter is not None else []
        return [state.tokens, state.position] + drafted + shape

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        state = self.state
        if state.sampling.greedy:
            return choose(logits, state.sampling, None)
        # the noise is the position's: each row chooses the position after its own (a tree row's from its depth)
        offsets = state.depth[: len(self.rows)] if self.tree else self.rows                          # [r]
        return choose(logits, state.sampling, gumbel(state.key, state.position + 1 + offsets, state.vocab))

    def layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The forward's rows: tokens [n], depth [n] and ancestors [n, n] (n = r, or r + S with side rows)."""
        state, r = self.state, len(self.rows)
        if self.side is None:
            return state.tokens[:r], state.depth[:r], state.ancestors[:r, :r]
        rows = self.run_rows
        return (state.tokens.index_select(0, rows), state.depth.index_select(0, rows),
                state.ancestors.index_select(0, rows).index_select(1, rows))

    def forward(self, tokens: torch.Tensor, depth: torch.Tensor, ancestors: torch.Tensor):
        """The target over the rows (layout()'s n): (hidden [1, n, d], {layer: H^l [1, n, d]} for the drafter's
        layers)."""
        target, state, n = self.target, self.state, len(tokens)
        state.cache.write_at = state.position + self.span                              # [n] slots, node order
        h0 = target.embed(tokens.view(1, -1))                                          # [1, n, d]
        if self.tree and target.hybrid:      # a linear-attention row follows its tree parent (the root: the position
            parents = state.parent[: len(self.rows)]                                   # before it)
            if self.side_parents is not None:
                parents = torch.cat([parents, self.side_parents])                      # [n]
            state.cache.parent_at = torch.where(self.span == 0, state.position - 1, state.position + parents)
        try:
            if not self.tree:
                positions = state.position + self.rows                                 # [n]
                hidden, captured = target.run_layers(h0, positions, 0, target.num_layers, state.cache,
                                                     self.capture, state.mask_keys)
            else:
                positions = state.position + depth                                     # [n]
                column = state.mask_keys - state.position                              # [1, S] slot - root's
                in_tree = (column >= 0) & (column < n)                                 # [1, S]
                node = column.clamp(0, n - 1).expand(n, -1)                            # [n, S]
                visible = (column < 0) | (in_tree & ancestors.gather(1, node))         # [n, S]
                keys = torch.where(in_tree[0], state.position + depth[node[0]], state.mask_keys[0])  # [S]
                hidden, captured = target.run_layers(h0, positions, 0, target.num_layers, state.cache,
                                                     self.capture, visible=(visible, keys))
        finally:
            state.cache.write_at = state.cache.parent_at = None
        if 0 in self.capture:
            captured[0] = h0
        return hidden, captured

    def step(self) -> torch.Tensor:
        """One cycle; returns the state's `out`."""
        state, r = self.state, len(self.rows)
        tokens = state.tokens[:r]                                                      # [r]
        hidden, captured = self.forward(*self.layout())
        logits = self.target.logits(hidden[0])                                         # [r (+ S), V]
        side = logits[r:].argmax(-1) if self.side is not None else None               # [S] branch drafts: argmax,
        logits = logits[:r]                                                            # no noise drawn
        chosen = self.choose(logits)                                                   # [r]
        real = self.rows <= state.drafts                                               # [r]
        if not self.tree:
            kept = kept_drafts(tokens[1:], chosen[:-1], real[1:])                      # [] drafts kept
            best, path = kept, self.rows                                               # the path is rows 0..kept
        else:
            kept, best, path = kept_path(tokens, chosen, real, state.depth[:r], state.parent[:r],
                                         state.ancestors[:r, :r])                      # [], [], [r]
            # the path's rows to slots root + depth (past the path: the root's, hidden by the mask until rewritten)
            state.cache.move(state.position + self.rows, state.position + path)
        verified = chosen.gather(0, path)                                              # [r] tokens 0..kept
        # the verified tokens are the target's own choices along the path: a kept draft equals its parent's choice
        top2 = logits.gather(0, best.view(1, 1).expand(1, logits.shape[-1])).float().topk(2, -1).values   # [1, 2]
        state.out[0] = kept + 1
        state.out[1] = top2[0, 0] - top2[0, 1]
        state.out[2: r + 2] = verified
        if side is not None:
            state.out[2 + state.tree_rows:].copy_(side)
            self.side.advance(side)
        if self.drafter is not None:
            self.drafter.observe({layer: h.index_select(1, path) for layer, h in captured.items()},
                                 DeviceVerified(verified, kept, state.position))
        state.position.add_(kept + 1)
        tokens[:1] = chosen.gather(0, best.view(1))
        if self.drafter is not None:
            self.drafter.propose(state.tokens[:1])
        return state.out
