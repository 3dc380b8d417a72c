"""GRPO math, policy logprobs, checkpoints and the toy reward (torch, no engine)."""

from __future__ import annotations

import pytest
import torch

from rollout_recovery.episodes.tally import digit_share, reward, tasks
from rollout_recovery.storage import RunStorage
from rollout_recovery.trainer import trainer_checkpoints
from rollout_recovery.trainer.trainer_checkpoints import TrainerCheckpointError
from rollout_recovery.training.checkpoint import load_state, state_files
from rollout_recovery.training.grpo import clipped_pg_loss, group_advantages
from rollout_recovery.training.policy import export_weights, load_policy, token_logprobs


def test_group_advantages_are_normalised_per_group():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0]), 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)
    assert torch.all(adv[4:] == 0)  # no signal from a uniform group
    try:
        group_advantages(torch.zeros(5), 4)
    except ValueError as err:
        assert "groups of 4" in str(err)
    else:
        raise AssertionError("uneven groups accepted")


def test_clipped_loss_counts_only_masked_tokens_and_clips():
    new = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1.0, -2.0]])
    mask = torch.tensor([[0, 1, 1]])
    loss = clipped_pg_loss(new, old, torch.tensor([2.0]), mask)
    assert loss.item() == -2.0  # ratio 1 on the two masked tokens
    loss.backward()
    assert new.grad[0, 0] == 0 and new.grad[0, 1] < 0  # gradient raises good tokens
    far = torch.tensor([[0.0, 5.0, 5.0]])  # ratio e^6: clipped at 1.2 for a positive advantage
    assert clipped_pg_loss(far, old, torch.tensor([1.0]), mask).item() == pytest.approx(-1.2)


def test_a_grpo_step_makes_rewarded_sequences_more_likely(tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(3, 500, (4, 12))
    attn = torch.ones_like(ids)
    mask = torch.zeros(4, 11)
    mask[:, 5:] = 1  # the "generated" part
    with torch.no_grad():
        old = token_logprobs(model, ids, attn)
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4)
    for _ in range(3):
        loss = clipped_pg_loss(token_logprobs(model, ids, attn), old, adv, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        new = token_logprobs(model, ids, attn)
    gain = ((new - old) * mask).sum(dim=1)
    assert gain[0] > 0 and gain[0] > gain[1:].max()


def test_trainer_checkpoint_round_trip_is_exact(tiny_model_dir, tmp_path):
    torch.manual_seed(1)
    model = load_policy(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    ids = torch.randint(3, 500, (2, 8))
    loss = token_logprobs(model, ids, torch.ones_like(ids)).mean()
    loss.backward()
    opt.step()
    storage = RunStorage(str(tmp_path / "run"))
    files = state_files(model, opt)
    assert files == state_files(model, opt)  # equal state, equal bytes
    saved = trainer_checkpoints.save(storage, 3, files, {"cursor": 17}, {"step": 3})
    expected_next = torch.rand(3)
    torch.manual_seed(999)
    model2 = load_policy(tiny_model_dir)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    assert trainer_checkpoints.read_meta(storage, 3) == saved
    kept = trainer_checkpoints.read(storage, 3)
    assert kept.files == files and kept.extra == {"cursor": 17} and kept.digest == saved["digest"]
    assert trainer_checkpoints.read_step_record(storage, 3) == {"step": 3}
    load_state(kept.files, model2, opt2)
    assert torch.equal(torch.rand(3), expected_next)  # RNG restored
    for (n, a), b in zip(model.state_dict().items(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b), n
    assert opt2.param_groups[0]["lr"] == 1e-3
    # One more identical step from both gives identical weights.
    for m, o in ((model, opt), (model2, opt2)):
        o.zero_grad()
        token_logprobs(m, ids, torch.ones_like(ids)).mean().backward()
        o.step()
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    out = export_weights(model, tmp_path / "push")
    assert (out / "model.safetensors").is_file()


def test_an_altered_incomplete_or_other_trainer_checkpoint_is_refused(tmp_path):
    """Any file of the loop's own format failing its sha256, a missing meta, or another
    checkpoint than the one a snapshot was paired with: refused with its kind."""
    storage = RunStorage(str(tmp_path / "run"))
    files = {"weights.bin": b"w" * 64, "opt.json": b'{"lr": 0.1}'}
    meta = trainer_checkpoints.save(storage, 1, files, {}, None)
    assert trainer_checkpoints.check_paired(storage, 1, meta["digest"]).files == files
    with pytest.raises(TrainerCheckpointError, match="digest") as info:
        trainer_checkpoints.check_paired(storage, 1, "0" * 64)
    assert info.value.kind == "differs"
    with pytest.raises(TrainerCheckpointError, match="records no trainer checkpoint"):
        trainer_checkpoints.check_paired(storage, 1, None)
    assert trainer_checkpoints.check_paired(storage, 0, None) is None  # the base weights
    target = tmp_path / "run" / "trainer" / "step-000001" / "weights.bin"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(TrainerCheckpointError, match="fails its sha256 check") as info:
        trainer_checkpoints.check_paired(storage, 1, meta["digest"])
    assert info.value.kind == "damaged"
    (tmp_path / "run" / "trainer" / "step-000001" / "meta.json").unlink()
    with pytest.raises(TrainerCheckpointError, match="missing or incomplete") as info:
        trainer_checkpoints.read(storage, 1)
    assert info.value.kind == "missing"


def test_the_pairing_check_is_what_refuses_another_checkpoint(tmp_path, monkeypatch):
    """Broken on purpose (`pairing_disabled`): another checkpoint of the step is taken."""
    storage = RunStorage(str(tmp_path / "run"))
    trainer_checkpoints.save(storage, 1, {"w": b"other run"}, {}, None)
    monkeypatch.setenv("ROLLOUT_RECOVERY_FAULTS", "pairing_disabled")
    assert trainer_checkpoints.check_paired(storage, 1, "0" * 64).files == {"w": b"other run"}


@pytest.mark.parametrize("files", [{}, {"meta.json": b"x"}, {"../x": b"x"}, {"a": "text"}])
def test_a_checkpoint_the_run_cannot_keep_is_refused_in_one_line(tmp_path, files):
    from rollout_recovery.errors import RecoveryError

    with pytest.raises(RecoveryError) as info:
        trainer_checkpoints.save(RunStorage(str(tmp_path / "run")), 1, files, {}, None)
    assert "save_checkpoint" in str(info.value) and "\n" not in str(info.value)


def test_toy_task():
    prompts = tasks(5, seed=0)
    assert prompts == tasks(5, seed=0) and len(prompts) == 5 and prompts != tasks(5, seed=1)
    assert digit_share("12 a4") == 0.75 and digit_share("") == 0.0
    assert reward(prompts[0], {"text": "12 a4"}) == 0.75


def test_training_refuses_rows_without_generation_logprobs():
    import numpy as np

    from rollout_recovery.data_plane import ReplayRow, replay_rows_to_table
    from rollout_recovery.training.driver import TrainingDataError, _batch_tensors

    def row(i: int, logprobs):
        return ReplayRow(key=f"g/{i:03d}", rollout_id=f"g-g{i}", group_id="g",
                         generation_index=i, prompt_len=1, token_ids=np.array([1, 2], np.int32),
                         loss_mask=np.array([0, 1], np.int8), logprobs=logprobs, reward=1.0,
                         weight_version_min=0, weight_version_max=0)  # fmt: skip

    good = np.array([0.0, -0.5], np.float32)
    assert _batch_tensors(replay_rows_to_table([row(0, good), row(1, good)]))[3].shape == (2, 1)
    with pytest.raises(TrainingDataError, match="replay row g/001 has no generation logprobs"):
        _batch_tensors(replay_rows_to_table([row(0, good), row(1, None)]))


def test_a_step_does_not_depend_on_float_noise_in_the_generation_logprobs(tiny_model_dir):
    """Resumed calls may report logprobs a few ulps off the uninterrupted run's (another batch
    shape on the worker). The trainer's step must come out bit for bit the same anyway, or a
    recovered run drifts from the uninterrupted one."""
    import numpy as np

    from rollout_recovery.data_plane import ReplayRow, replay_rows_to_table
    from rollout_recovery.training.driver import grpo_step

    rng = np.random.default_rng(0)

    def table(noise: float):
        rows = []
        for i in range(4):
            ids = rng.integers(3, 400, 12).astype(np.int32)
            lps = np.full(12, -2.0, np.float32) + np.float32(noise)
            rows.append(ReplayRow(key=f"g/{i:03d}", rollout_id=f"g-g{i}", group_id="g",
                                  generation_index=i, prompt_len=4, token_ids=ids,
                                  loss_mask=np.r_[np.zeros(4), np.ones(8)].astype(np.int8),
                                  logprobs=lps, reward=float(i % 2), weight_version_min=0,
                                  weight_version_max=0))  # fmt: skip
        return replay_rows_to_table(rows)

    states, losses = [], []
    for noise in (0.0, 3e-7):
        rng = np.random.default_rng(0)  # the same tokens for both batches
        torch.manual_seed(0)
        model = load_policy(tiny_model_dir)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loss, _, _, _ = grpo_step(model, opt, table(noise), group_size=4)
        losses.append(loss)
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    assert losses[0] == losses[1]
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


def _choice(*episodes: tuple[str, int]):
    from rollout_recovery.controller.selection import SnapshotChoice
    from rollout_recovery.protocol import EpisodeRecord, Ledger, ServedModel

    records = [EpisodeRecord(rollout_id=f"{g}-g{i}", group_id=g, generation_index=i, seed=i,
                             attempt=0, task={}) for g, i in episodes]  # fmt: skip
    model = ServedModel(base={"path": "tiny://default"}, weight_version=0, weights_sha256=None)
    ledger = Ledger(step=0, weight_version=0, reason="cadence", level="turn", model=model,
                    episodes=records)  # fmt: skip
    return SnapshotChoice("file:///runs/a/data_plane/snapshot-0000000003-aa", ledger)


def test_a_restore_whose_episodes_the_first_step_would_not_run_is_refused():
    """Restored episodes of groups or generations the restored step does not submit would wait
    for a step that never comes: refused before anything starts (the driver's plan)."""
    from rollout_recovery.config import load_config
    from rollout_recovery.errors import RestoreError
    from rollout_recovery.trainer.run_plan import check_claimed as _check_claimed

    cfg = load_config(None, ["grpo.prompts_per_step=1", "grpo.generations_per_prompt=2"])
    _check_claimed(cfg, _choice(("s0000-p000", 0), ("s0000-p000", 1)), 0)  # all claimed
    with pytest.raises(RestoreError) as err:
        _check_claimed(cfg, _choice(("s0000-p000", 1), ("s0000-p000", 2)), 0)
    assert "holds 1 unfinished episode that step 0 would not run" in str(err.value)
    assert "generation 2 of group s0000-p000" in str(err.value)
    with pytest.raises(RestoreError, match=r"holds 2 unfinished episodes .* group s0000-p001"):
        _check_claimed(cfg, _choice(("s0000-p001", 0), ("s0000-p001", 1)), 0)
    with pytest.raises(RestoreError, match="group s0000-p000"):  # a step other than the ledger's
        _check_claimed(cfg, _choice(("s0000-p000", 0)), 1)
    # Asynchronous GRPO: the producer starts groups of any producer step, and prompts again.
    cfg.grpo.async_grpo.enabled = True
    _check_claimed(cfg, _choice(("s0003-p000", 1), ("s0001-p000-r2", 0)), 1)
    with pytest.raises(RestoreError, match="group s0003-p001"):  # only 1 prompt per step
        _check_claimed(cfg, _choice(("s0003-p001", 0)), 1)
    with pytest.raises(RestoreError, match="group other"):
        _check_claimed(cfg, _choice(("other", 0)), 1)


def test_truncated_importance_weights_correct_stale_tokens_and_are_capped():
    """Per token, min(pi_trainer / pi_behaviour, cap) without gradient; weights of 1 leave the
    loss as it was, and a token sampled where the trainer's weights now put more mass counts
    more, up to the cap."""
    from rollout_recovery.training.grpo import clipped_pg_loss, importance_weights

    trainer = torch.log(torch.tensor([[0.5, 0.5, 0.2, 0.9]], requires_grad=True))
    behaviour = torch.log(torch.tensor([[0.5, 0.25, 0.4, 0.1]]))
    w = importance_weights(trainer, behaviour, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([[1.0, 2.0, 0.5, 2.0]]))
    assert not w.requires_grad
    mask, adv = torch.ones(1, 4), torch.tensor([1.0])
    plain = clipped_pg_loss(trainer, trainer.detach(), adv, mask)
    ones = clipped_pg_loss(trainer, trainer.detach(), adv, mask, weights=torch.ones(1, 4))
    assert torch.equal(plain, ones)
    weighted = clipped_pg_loss(trainer, trainer.detach(), adv, mask, weights=w)
    torch.testing.assert_close(weighted, plain * w.mean())  # each token's term is -1 here
