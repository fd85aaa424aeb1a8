"""Draft-model proposer: a smaller model with the same tokenizer proposes k tokens per request.

The draft model keeps its own paged KV cache, indexed by the SAME block tables as the target (the
scheduler's blocks cover both), so no second allocator exists. Per slot it remembers how many
positions of its cache are certainly valid (`draft_len`); after each target step it catches up on
the tokens the target confirmed since (accepted drafts + the bonus token, or a whole prompt after
a prefill) and then runs k-1 single-token steps. Drafts are sampled from the draft's processed
distribution with keyed noise, and that distribution is kept for rejection sampling.
"""

from __future__ import annotations

import torch

from kernels.attention import AttentionMetadata
from kernels.keyed_random import keyed_uniform
from kernels.slot_mapping import compute_slot_mapping
from worker_svc.model import allocate_kv_cache
from worker_svc.sampler import SEED_MASK, SamplingTensors, target_probs

# Keyed-noise stream for draft sampling; 0-2 belong to the target's sampler and verifier.
DRAFT_STREAM = 3


class DraftModelProposer:
    """Runs a draft model over the runner's history pages and block tables."""

    has_draft_probs = True

    def __init__(self, draft, num_spec_tokens: int) -> None:
        self.draft = draft  # a worker_svc.model_loader.LoadedModel
        self.k = num_spec_tokens
        # The draft model writes its k-token chain into the KV slots past the step's tokens.
        self.num_lookahead_slots = num_spec_tokens
        self.runner = None

    def bind(self, runner) -> None:
        if self.draft.hf_config.vocab_size != runner.loaded.hf_config.vocab_size:
            raise ValueError(f"draft model vocab {self.draft.hf_config.vocab_size} differs from the "
                             f"target's {runner.loaded.hf_config.vocab_size}: they must share a tokenizer")
        self.runner = runner
        cfg = runner.config
        self.kv_caches = allocate_kv_cache(self.draft.hf_config, cfg.num_blocks, cfg.block_size,
                                           self.draft.model.dtype, runner.device)
        num_slots = cfg.max_num_seqs
        self.draft_len = torch.zeros(num_slots, dtype=torch.int32, device=runner.device)
        self.probs = torch.zeros(num_slots, self.k, self.draft.hf_config.vocab_size,
                                 dtype=torch.float32, device=runner.device)

    def admit(self, slot: int, num_cached_tokens: int) -> None:
        # Prefix-cached blocks need not carry draft K/V: the scheduler registers a block once the
        # target's K/V are written, which for a non-sampling prefill chunk is before the draft
        # ever catches up on it (and its owner may be preempted before it does). So the draft
        # recomputes the cached prefix in its first catch-up.
        self.draft_len[slot] = 0

    def release(self, slot: int) -> None:
        pass

    def _forward(self, slots: torch.Tensor, token_lists: list[list[int]] | torch.Tensor,
                 starts: list[int]) -> torch.Tensor:
        """Feed rows of tokens at positions starts[r].. and return the last token's logits."""
        st = self.runner.state
        dev = self.runner.device
        lens = [len(t) for t in token_lists]
        qsl_host = [0]
        for n in lens:
            qsl_host.append(qsl_host[-1] + n)
        flat = [t for row in token_lists for t in row]
        positions = torch.tensor([s + j for s, n in zip(starts, lens) for j in range(n)],
                                 dtype=torch.long, device=dev)
        qsl = torch.tensor(qsl_host, dtype=torch.int32, device=dev)
        bs = self.runner.config.block_size
        max_blocks = max(-(-(s + n) // bs) for s, n in zip(starts, lens))
        tables = st.block_table[slots.long(), :max_blocks]
        slot_mapping = compute_slot_mapping(qsl, positions, tables, bs)
        meta = AttentionMetadata(
            query_start_loc=qsl,
            seq_lens=torch.tensor([s + n for s, n in zip(starts, lens)], dtype=torch.int32, device=dev),
            block_tables=tables, max_query_len=max(lens), max_seq_len=max_blocks * bs,
            slot_mapping=slot_mapping)
        hidden = self.draft.model(torch.tensor(flat, dtype=torch.long, device=dev), positions, meta,
                                  self.kv_caches)
        last = torch.tensor(qsl_host[1:], dtype=torch.long, device=dev) - 1
        return self.draft.model.compute_logits(hidden[last])

    def propose(self, slots: torch.Tensor, kv_caches: list) -> None:
        runner = self.runner
        st = runner.state
        idx = slots.long()
        # Host copies of the lengths: the catch-up rows have data-dependent lengths.
        seq_lens = st.seq_len[idx].tolist()
        draft_lens = self.draft_len[idx].tolist()
        last = st.last_token[idx].tolist()
        pages = st.history.view(-1)
        bs = runner.config.block_size
        # Never write past the blocks a request holds. The scheduler only allocates the k
        # lookahead slots when blocks are free, and after a fully accepted step even the last
        # token's slot may not be allocated yet. A row without room proposes fewer drafts (none
        # if its catch-up does not fit) and, for the forwards it still takes part in, re-feeds
        # one confirmed token at its own position: that rewrites identical K/V, whereas writing
        # any other token there would corrupt a position `draft_len` vouches for.
        caps = [len(runner.slots_by_index[s].block_ids) * bs for s in slots.tolist()]

        def confirmed(slot: int, r: int, lo: int, hi: int) -> list[int]:
            """Confirmed tokens at positions [lo, hi) (history pages, then the last token)."""
            pos = torch.arange(lo, min(hi, seq_lens[r]), device=runner.device)
            flat = st.block_table[slot, pos // bs].long() * bs + pos % bs
            return pages[flat].tolist() + ([last[r]] if hi > seq_lens[r] else [])

        rows: list[list[int]] = []
        starts = list(draft_lens)
        refeed: list[tuple[int, list[int]]] = []
        num_valid = [self.k] * len(caps)
        for r, slot in enumerate(slots.tolist()):
            end = min(seq_lens[r] + 1, caps[r])
            if end <= seq_lens[r]:
                num_valid[r] = 0
                starts[r] = min(draft_lens[r], end - 1)
            rows.append(confirmed(slot, r, starts[r], end))
            refeed.append((end - 1, confirmed(slot, r, end - 1, end)))
        new_draft_lens = [min(n + 1, cap) for n, cap in zip(seq_lens, caps)]
        infos = [runner.slots_by_index[s].sampling for s in slots.tolist()]
        drafts = torch.zeros(len(rows), self.k, dtype=torch.int32, device=runner.device)
        probs = torch.zeros(len(rows), self.k, self.draft.hf_config.vocab_size,
                            dtype=torch.float32, device=runner.device)
        tokens = rows
        for j in range(self.k):
            for r in range(len(rows)):
                if j > 0 and (num_valid[r] < j or starts[r] + 1 > caps[r]):
                    num_valid[r] = min(num_valid[r], j)
                    starts[r], tokens[r] = refeed[r]
            logits = self._forward(slots, tokens, starts)
            # Draft token j sits at absolute position seq_len + 1 + j.
            positions = torch.tensor([s + 1 + j for s in seq_lens], dtype=torch.long,
                                     device=runner.device)
            t = SamplingTensors.from_params(
                temperatures=[p.temperature for p in infos], top_ks=[p.top_k for p in infos],
                top_ps=[p.top_p if p.top_p > 0 else 1.0 for p in infos],
                seeds=[p.seed & SEED_MASK for p in infos], positions=positions, device=runner.device)
            q = target_probs(logits, t)
            noise = keyed_uniform(t.seeds, positions, q.shape[-1], stream=DRAFT_STREAM)
            gumbel = -torch.log(-torch.log(noise))
            token = torch.argmax(torch.log(q) + gumbel, dim=-1)
            drafts[:, j] = token.to(torch.int32)
            probs[:, j] = q
            starts = [s + len(tok) for s, tok in zip(starts, tokens)]
            tokens = [[x] for x in token.tolist()]
        # Only the confirmed prefix (through the bonus token) is certainly valid next time.
        self.draft_len[idx] = torch.tensor(new_draft_lens, dtype=torch.int32, device=runner.device)
        st.drafts[idx, : self.k] = drafts
        st.num_drafts[idx] = torch.tensor(num_valid, dtype=torch.int32, device=runner.device)
        self.probs[idx] = probs

    def draft_probs(self, slots: torch.Tensor, k: int) -> torch.Tensor:
        return self.probs[slots.long(), :k]
