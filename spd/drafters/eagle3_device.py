"""EAGLE-3's chain and tree drafted inside the device step (spd.runtime.device_step): the module's K/V in a static
cache, its rows written at their slots, so that a cycle's update (the verified positions' step-0 rows from the
target's fused features) and its drafts are tensors in, tensors out — no host read, one compiled graph with the
target's forward. The same module, rows and rule as spd.drafters.eagle3: a chain of the module's argmax, or (W > 1)
EAGLE-2's dynamic tree — W children a node by top-W of q, the W best of each level's children by cumulative log q
expanded further, the `budget` best of all kept, parents first. Drafts are deterministic, so verification keeps
each with exactly the target's probability and the output is the target's own at every T.

A step-0 row for verified position i sits at slot i. A chain's draft j >= 1 is a temporary row at the slot after the
newest verified position + j - 1; a tree's level l (W rows, all at the position of the chain's draft l + 1) sits at
the W slots from the newest verified position + l W. The next cycle's step-0 rows overwrite them, and the mask
hides what lies past a row's own position or outside its ancestors, so a stale temporary row is never read."""

from __future__ import annotations

import torch

from spd.drafters.base import CHAIN, DEVICE, TREES, DeviceVerified, Drafter
from spd.models.attention import attend_block
from spd.models.eagle3 import Eagle3Module


class Eagle3DeviceDrafter(Drafter):
    capabilities = frozenset({CHAIN, TREES, DEVICE})

    def __init__(self, module: Eagle3Module, embed):
        self.module = module
        self.embed = embed    # token ids [1, S] -> H^0 [1, S, d] (the target's own embedding)
        self.keys = None
        self.depth, self.width = 1, 1
        self.drafts = self.tree = None

    def layers_needed(self, bounds=None) -> list[int]:
        return self.module.layers_needed()

    def mutable(self) -> list[torch.Tensor]:
        """What a step writes that the next step reads (a CUDA graph's warm-ups restore it)."""
        return [self.last_h, self.rows]

    def candidates(self, depth: int, width: int) -> int:
        """A tree's candidate nodes: the root's W children, then W^2 at each further level."""
        return width + (depth - 1) * width * width

    def bind(self, length: int, drafts: torch.Tensor, depth: int = 1, width: int = 1, tree=None) -> None:
        """Where a request's drafts go: drafts [m] (a chain), or drafts [budget] and `tree`'s depth, parent and
        ancestors (W > 1: `depth` levels of `width` children); a static cache of `length` slots (and a tree's
        temporary rows past them)."""
        m, device = self.module, drafts.device
        self.depth, self.width, self.drafts, self.tree = depth, width, drafts, tree
        attn = m.layer.self_attn
        kv_heads = m.config.num_key_value_heads
        length += (depth - 1) * width if width > 1 else 0
        if self.keys is None or self.keys.shape[2] != length:
            self.keys = torch.zeros(1, kv_heads, length, attn.head_dim, device=device, dtype=m.fc.weight.dtype)
            self.values = torch.zeros_like(self.keys)
            self.slots = torch.arange(length, device=device)                          # [S]
            self.last_h = torch.zeros(1, 1, m.config.hidden_size, device=device, dtype=m.fc.weight.dtype)
            self.rows = torch.zeros((), dtype=torch.long, device=device)               # [] verified step-0 rows

    @torch.no_grad()
    def start(self, prompt_hidden: dict[int, torch.Tensor], tokens: torch.Tensor) -> None:
        """The prompt's step-0 rows (prompt_hidden {layer: [1, P, d]}; each row also reads the token after it:
        tokens [P + 1], the prompt then the first generated token, on the device), and the first drafts."""
        last = torch.tensor(tokens.shape[0] - 2, device=tokens.device)
        self.observe(prompt_hidden, DeviceVerified(tokens[1:], last, torch.zeros_like(last)))
        self.propose(tokens[-1:])

    def _run(self, embedding: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Rows (embedding, h) [1, r, d] at positions [r]: their K/V written at `slots` [r] (default: their
        positions), each attending to the slots `visible` [r, S] allows (default: every slot up to its own
        position). Returns the layer's outputs [1, r, d]."""
        m = self.module
        cos, sin = m.rope(positions.view(1, -1), h)
        q, k, v, gate = m.project(embedding, h, cos, sin)
        slots = positions if slots is None else slots
        self.keys.index_copy_(2, slots, k)
        self.values.index_copy_(2, slots, v)
        if visible is None:
            visible = self.slots.view(1, -1) <= positions.view(-1, 1)                  # [r, S]
        none = k.new_zeros(*k.shape[:3], 0, k.shape[-1])
        return m.finish(h, attend_block(q, self.keys, self.values, visible.unsqueeze(0), none, none, None,
                                        m.layer.self_attn.scaling), gate)

    def _log_q(self, h: torch.Tensor) -> torch.Tensor:
        """log q over the target's vocabulary [r, V] for the rows h [1, r, d] (as spd.verify.sampling.children_of_rows)."""
        return torch.log_softmax(self.module.target_logits(self.module.logits(h))[0].float(), -1)

    def observe(self, hidden: dict[int, torch.Tensor], verified: DeviceVerified) -> None:
        """The cycle's rows, root first along the accepted path (hidden {layer: [1, r, d]}), and the token after
        each: step-0 rows for positions verified.position.. (those past verified.kept are hidden until rewritten);
        the newest kept row's output drafts next."""
        verified, kept, position = verified
        r = verified.shape[0]
        positions = position + torch.arange(r, device=verified.device)                # [r]
        out = self._run(self.embed(verified.view(1, -1)), self.module.fuse(hidden), positions)   # [1, r, d]
        self.last_h.copy_(out.index_select(1, kept.view(1)))
        self.rows.copy_(position + kept + 1)

    def propose(self, root: torch.Tensor, choose=None) -> None:
        """The bound drafts [m] <- the chain after the newest verified token root [1] (greedy in the module's own
        q); with a bound tree (W > 1), the tree's nodes and its structure there."""
        drafts, tree = self.drafts, self.tree
        if tree is not None:
            return self.draft_tree(root, drafts, tree)
        h, previous = self.last_h, root                                                # [1, 1, d], [1]
        for j in range(drafts.shape[0]):
            if j:
                h = self._run(self.embed(previous.view(1, 1)), h, (self.rows + j - 1).view(1))
            token = self.module.target_logits(self.module.logits(h))[0, -1].argmax().view(1)   # [1]
            drafts[j: j + 1] = token
            previous = token

    def draft_tree(self, root: torch.Tensor, drafts: torch.Tensor, tree) -> None:
        """The dynamic tree of spd.drafters.eagle3 with fixed shapes: every level's W^2 children are candidates
        (scores in float64 as the host's Python floats, ties to the earlier candidate as its stable sort), the
        budget = len(drafts) best of all are the nodes. Writes drafts [B], and tree.depth, tree.parent,
        tree.ancestors over the first B + 1 rows (row 0 the root)."""
        width, levels, device = self.width, self.depth, root.device
        temp = (levels - 1) * width                                                    # temporary rows
        lp, token = self._log_q(self.last_h).topk(width, -1)                          # [1, W], [1, W]
        score, token = lp[0].double(), token[0]                                        # [W] the frontier's
        scores, tokens = [score], [token]                                              # per level: [W], then [W^2]
        parents = [torch.full((width,), -1, device=device)]
        depths = [torch.ones(width, dtype=torch.long, device=device)]
        frontier = torch.arange(width, device=device)                                  # [W] candidate ids
        h = self.last_h.expand(1, width, -1)                                           # [1, W, d] parents' outputs
        lanes = torch.arange(width, device=device)                                     # [W]
        temps = torch.arange(max(temp, 1), device=device)                              # [T]
        seen = torch.zeros(width, len(temps), dtype=torch.bool, device=device)         # [W, T] temp rows seen
        column = self.slots - self.rows                                                # [S] slot - first temp
        in_temp = (column >= 0) & (column < temp)                                      # [S]
        for level in range(levels - 1):
            seen = seen | (temps.view(1, -1) == lanes.view(-1, 1) + level * width)     # each sees its own row
            visible = (column < 0) | (in_temp & seen.gather(1, column.clamp(0, temp - 1).expand(width, -1)))
            out = self._run(self.embed(token.view(1, -1)), h, (self.rows + level).expand(width),
                            self.rows + level * width + lanes, visible)               # [1, W, d]
            lp, child = self._log_q(out).topk(width, -1)                               # [W, W], [W, W]
            grown = (score.view(-1, 1) + lp.double()).flatten()                        # [W^2]
            scores.append(grown)
            tokens.append(child.flatten())
            parents.append(frontier.repeat_interleave(width))
            depths.append(torch.full((width * width,), level + 2, device=device))
            best = grown.sort(descending=True, stable=True).indices[:width]           # [W]
            frontier = self.candidates(level + 1, width) + best                          # ids after the levels so far
            score, token = grown.index_select(0, best), tokens[-1].index_select(0, best)
            h = out.index_select(1, best // width)
            seen = seen.index_select(0, best // width)
        select(torch.cat(scores), torch.cat(tokens), torch.cat(parents), torch.cat(depths), levels, drafts, tree)


def select(score: torch.Tensor, token: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor, levels: int,
           drafts: torch.Tensor, tree) -> None:
    """The budget = len(drafts) best candidates (score, token, parent, depth [C]) as the tree's rows, parents first
    (by depth, then score, as spd.drafters.eagle3): a child scores at most its parent and ties go to the earlier
    candidate, so the best B are closed under ancestors."""
    budget, device = drafts.shape[0], drafts.device
    rows = budget + 1
    chosen = score.sort(descending=True, stable=True).indices[:budget]                # [B]
    chosen = chosen.index_select(0, depth.index_select(0, chosen).sort(stable=True).indices)
    row_of = torch.zeros_like(depth)                                                   # [C] candidate -> row
    row_of.index_copy_(0, chosen, torch.arange(1, rows, device=device))
    above = parent.index_select(0, chosen)                                             # [B] parent candidates
    up = torch.cat([above.new_zeros(1), torch.where(above < 0, 0, row_of.index_select(0, above.clamp(min=0)))])
    drafts.copy_(token.index_select(0, chosen))
    tree.depth[:rows].copy_(torch.cat([depth.new_zeros(1), depth.index_select(0, chosen)]))
    tree.parent[:rows].copy_(up)
    eye = torch.eye(rows, dtype=torch.bool, device=device)                            # [R, R]
    ancestors = eye
    for _ in range(levels):
        ancestors = eye | ancestors.index_select(0, up)
    tree.ancestors[:rows, :rows].copy_(ancestors)


def device_drafter(*, module: Eagle3Module, embed) -> Eagle3DeviceDrafter:
    """EAGLE-3's drafter inside the device step (spd.methods): its module, fed the target's embedding."""
    return Eagle3DeviceDrafter(module, embed)
