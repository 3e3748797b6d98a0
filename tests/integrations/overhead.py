"""Per-step time of each integration against the engine's own loop on the same model and data (run by hand; the
figures are in docs/integrations.md). ZeRO-3, 2 processes, rounds interleaved so a change in machine load hits
every loop alike; each round reports the median of the steps after WARM.

torchrun --nproc_per_node 2 tests/integrations/overhead.py [ROUNDS]
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from moe_lst.models.llama import ModelConfig, Transformer

import zero
from tests.integrations.common import EpochSampler, HFRows, MicroBatches, train_stream

STEPS, WARM, MICRO, ACCUM = 12, 2, 4, 2
CONFIG = ModelConfig(vocab_size=256, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, max_seq_len=512)  # 3.0M
ZERO = {"stage": 3}


def llama() -> Transformer:
    torch.manual_seed(0)
    return Transformer(CONFIG)


def hf_llama():
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=512))


def timed_loop(model, next_batch, loss_of) -> list[float]:
    """The engine's own loop: the time of each optimizer step, data included."""
    engine = zero.initialize(model, zero.FastAdamW(lr=1e-3), zero.ZeroConfig(grad_accum_steps=ACCUM, **ZERO))
    times = []
    for step in range(STEPS):
        t = time.perf_counter()
        for micro in range(ACCUM):
            engine.backward(loss_of(engine, *next_batch(step, micro)))
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def own_llama() -> list[float]:
    stream, rank = train_stream(dist.get_world_size()), dist.get_rank()
    return timed_loop(llama(), lambda s, m: stream.batch(s, m, rank),
                      lambda e, x, y: F.cross_entropy(e(x).flatten(0, 1), y.flatten()))


def accelerate_llama() -> list[float]:
    from accelerate import Accelerator
    from moe_lst.integrations.accelerate_example import StreamRows

    accelerator = Accelerator(cpu=True)
    loader = torch.utils.data.DataLoader(StreamRows(train_stream(dist.get_world_size()), STEPS), MICRO)
    batches = iter(accelerator.prepare(loader))
    return timed_loop(llama(), lambda s, m: next(batches),
                      lambda e, x, y: F.cross_entropy(e(x).flatten(0, 1), y.flatten()))


def own_hf() -> list[float]:
    stream, rank = train_stream(dist.get_world_size()), dist.get_rank()
    return timed_loop(hf_llama(), lambda s, m: stream.batch(s, m, rank)[:1],
                      lambda e, x: e(input_ids=x, labels=x).loss)


def lightning_llama() -> list[float]:
    import lightning as L
    from moe_lst.integrations.lightning import ZeroStrategy

    times: list[float] = []

    class Module(L.LightningModule):
        def configure_model(self):
            self.model = llama()

        def training_step(self, batch, index):
            if index % ACCUM == 0:
                self.t = time.perf_counter()
            x, y = batch
            return F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())

        def on_train_batch_end(self, outputs, batch, index):
            if index % ACCUM == ACCUM - 1:
                times.append(time.perf_counter() - self.t)

        def configure_optimizers(self):
            return zero.FastAdamW(lr=1e-3)

        def train_dataloader(self):
            dims = self.trainer.strategy.dims
            rows = MicroBatches(train_stream(dims.dp), dims.dp_rank, STEPS * ACCUM)
            return torch.utils.data.DataLoader(rows, batch_size=None, sampler=EpochSampler(STEPS * ACCUM))

    trainer = L.Trainer(strategy=ZeroStrategy(zero.ZeroConfig(**ZERO)), accelerator="cpu", devices=2, max_epochs=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, accumulate_grad_batches=ACCUM, use_distributed_sampler=False)
    trainer.fit(Module())
    return times


def trainer_hf() -> list[float]:
    import transformers
    from moe_lst.integrations.transformers import ZeroTrainer

    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.t = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.t)

    args = transformers.TrainingArguments(
        output_dir="/tmp/overhead_hf", per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_steps=STEPS, train_sampling_strategy="sequential", save_strategy="no", report_to="none",
        disable_tqdm=True, use_cpu=True, logging_steps=10_000)
    ZeroTrainer(model=hf_llama(), args=args, train_dataset=HFRows(train_stream(dist.get_world_size()), STEPS),
                zero_config=zero.ZeroConfig(**ZERO), optimizer_factory=zero.FastAdamW(lr=1e-3),
                callbacks=[Clock()]).train()
    return times


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dist.init_process_group("gloo")
    loops = {"own_llama": own_llama, "accelerate": accelerate_llama, "lightning": lightning_llama,
             "own_hf": own_hf, "trainer_hf": trainer_hf}
    medians: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, loop in loops.items():
            times = sorted(loop()[WARM:])
            medians.setdefault(name, []).append(times[len(times) // 2])
            if dist.get_rank() == 0:
                print(f"round {r} {name}: {medians[name][-1] * 1e3:.0f} ms/step", flush=True)
    if dist.get_rank() == 0:
        print(json.dumps({name: min(values) for name, values in medians.items()}))


if __name__ == "__main__":
    main()
