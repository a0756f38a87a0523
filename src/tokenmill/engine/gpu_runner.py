"""ModelRunner's counterpart for a model on a GPU (engine/runner.py has the CPU one): the same
micro-batches, sampled rows and prompt rows, with the step's inputs uploaded in one copy, attention
through tokenmill.kernels.gpu (model/gpu/batch.py) and decode-only micro-batches replayed as CUDA
graphs (model/gpu/graphs.py) when they were captured. Logits stay on the device for the sampler.

Nothing here needs CUDA itself: on CPU tensors the kernels take their PyTorch references, which is how
the tests hold this runner to the CPU one (tests/engine/gpu/test_device_runner.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from tokenmill.engine.runner import PromptRows, StepOutput, UbatchInputs, split_ubatches
from tokenmill.engine.scheduler import ScheduledBatch
from tokenmill.kvcache import BlockManager
from tokenmill.kvcache.storage import KVStorage
from tokenmill.model.attention import ChunkSpec
from tokenmill.model.gpu.batch import HostBatch, upload
from tokenmill.model.gpu.buckets import DecodeRows
from tokenmill.model.gpu.device import device_name
from tokenmill.model.gpu.graphs import DecodeGraphs
from tokenmill.model.gpu.memory import tensors_bytes


class DeviceModelRunner:
    supports_decode_steps = True  # run_decode_steps (engine/decode_steps.py)

    def __init__(self, model: torch.nn.Module, kv: KVStorage, blocks: BlockManager, n_ubatch: int,
                 graphs: DecodeGraphs | None = None):
        self.model = model
        self.kv = kv
        self.blocks = blocks
        self.n_ubatch = n_ubatch
        self.graphs = graphs
        self.device = kv.device
        # Every rotary table of the model has the same length (the context's); positions are checked
        # against it here, on the host, since the device step does not look at them.
        self.max_positions = model.rope.cos.shape[0]
        self.graph_steps = 0       # micro-batches replayed from a CUDA graph
        self.step_graph_steps = 0  # (the CPU runner's compiled prefill graphs; none here)

    # --- what the server and the device report read ---------------------------------------------
    @property
    def weights_bytes(self) -> int:
        return tensors_bytes(self.model)

    @property
    def kv_bytes(self) -> int:
        return self.kv.nbytes

    @property
    def device_name(self) -> str:
        return device_name(self.device)

    # --- steps ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> StepOutput:
        """Logits of the sampling rows (bf16, on the device), and the hidden states of prompt rows to score."""
        logits: list[torch.Tensor] = []
        prompt_rows: list[PromptRows] = []
        for ubatch in split_ubatches(batch.chunks, self.n_ubatch):
            ids, positions, specs, sample_rows, scored = UbatchInputs.build(ubatch, self.blocks)
            self._check_positions(positions)
            hidden = None if scored else self._run_graph(ids, positions, specs)
            if hidden is not None:
                if sample_rows:
                    every_row = len(sample_rows) == len(ids)
                    rows = None if every_row else torch.tensor(sample_rows, device=self.device)
                    logits.append(self.model.logits(hidden, rows))
                continue
            step = upload(HostBatch.build(specs, self.kv.block_size), ids, positions, sample_rows,
                          self.kv.block_size, self.device)
            hidden = self.model(step.input_ids, step.positions, step.batch, self.kv)
            if sample_rows:
                logits.append(self.model.logits(hidden, step.sample_rows))
            for seq, where, row in scored:
                prompt_rows.append(PromptRows(seq, where.start, hidden[row:row + len(where)].clone()))
        if not logits:
            return StepOutput(None, prompt_rows)
        return StepOutput(logits[0] if len(logits) == 1 else torch.cat(logits), prompt_rows)

    @torch.inference_mode()
    def run_decode_steps(self, batch: ScheduledBatch, steps: int,
                         sample: Callable[[torch.Tensor, int, list[torch.Tensor]], torch.Tensor]) -> list[list[int]]:
        """`steps` decode steps of a decode-only batch (one row per chunk, each sampled) in a row: step
        j computes position start + j of every row, its input the token that step j - 1's
        sample(logits, j - 1, the steps' tokens before) picked on the device. The sequences' blocks must hold all the positions (Scheduler.reserve_decode_steps).
        Returns each step's tokens ([steps][rows]), read from the device once."""
        chunks = batch.chunks
        if len(chunks) > self.n_ubatch:
            raise ValueError(f"{len(chunks)} rows exceed a micro-batch ({self.n_ubatch})")
        tables = [self.blocks.block_table(c.seq.seq_id) for c in chunks]
        first_ids = [c.seq.token_ids_between(c.start, c.start + 1)[0] for c in chunks]
        self._check_positions([c.start + steps - 1 for c in chunks])
        tokens: list[torch.Tensor] = []
        replaying = False  # the run's first step went into a graph's buffers: the rest advance there
        for j in range(steps):
            prev = tokens[-1] if tokens else None
            if replaying:
                self.graph_steps += 1
                hidden = self.graphs.run_next(prev)
            else:
                positions = [c.start + j for c in chunks]
                specs = [ChunkSpec(t, p, 1) for t, p in zip(tables, positions)]
                hidden = self._run_graph(first_ids, positions, specs, prev, tables, steps_ahead=steps - 1 - j)
                replaying = hidden is not None
            if hidden is None:
                step = upload(HostBatch.build(specs, self.kv.block_size), first_ids, positions, [],
                              self.kv.block_size, self.device)
                if prev is not None:
                    step.input_ids.copy_(prev)
                hidden = self.model(step.input_ids, step.positions, step.batch, self.kv)
            tokens.append(sample(self.model.logits(hidden), j, tokens))
        return torch.stack(tokens).tolist()

    @torch.inference_mode()
    def hidden_states(self, ids: list[int], start: int, block_table) -> torch.Tensor:
        """One sequence's chunk at positions start.. run eagerly (embeddings): its last layer's hidden
        states, its K/V written to the cache."""
        positions = list(range(start, start + len(ids)))
        self._check_positions(positions)
        step = upload(HostBatch.build([ChunkSpec(block_table, start, len(ids))], self.kv.block_size), ids, positions,
                      [], self.kv.block_size, self.device)
        return self.model(step.input_ids, step.positions, step.batch, self.kv)

    def _check_positions(self, positions: list[int]) -> None:
        if positions and max(positions) >= self.max_positions:
            raise ValueError(f"position {max(positions)} beyond the rotary table ({self.max_positions})")

    def _run_graph(self, ids: list[int], positions: list[int], specs: list[ChunkSpec],
                   device_ids: torch.Tensor | None = None, tables: list | None = None,
                   steps_ahead: int = 0) -> torch.Tensor | None:
        """Decode-only micro-batches replay a captured graph; None when this one cannot (no graphs,
        a prefill chunk, more rows or blocks than were captured): the caller runs it eagerly.
        device_ids: the rows' input ids on the device, in place of ids; tables: the specs' block
        tables as one list, the same for every step of a run, whose buffers then keep them
        (run_decode_steps); steps_ahead: how many steps of a run will follow this one in the graph's
        buffers (its blocks must fit them too)."""
        g = self.graphs
        if g is None or any(s.num_new != 1 for s in specs):
            return None
        bs = self.kv.block_size
        lens = [s.num_cached + 1 for s in specs]
        if not g.accepts(len(specs), -(-(max(lens) + steps_ahead) // bs)):
            return None
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(specs, positions)]
        self.graph_steps += 1
        tables = [s.block_table for s in specs] if tables is None else tables
        return g.run(DecodeRows(ids, positions, slots, tables, lens), device_ids, steps_ahead)
