"""experiments/tiny_steps.py's scoring of the README prompts (the study itself runs on a GPU)."""

import numpy as np
import pytest
from PIL import Image

from dsv_jax.data import synthetic
from experiments.tiny_steps import RUNS, Run, prompts_shown, readme_answers, save_frames, train_command


def _clips(n=4, shape=(8, 32, 32)):
    """n moving clips of n different colours (so that a clip under another's caption gets its colour wrong)."""
    rendered, colours = [], set()
    for key in range(100):
        frames, caption = synthetic.render(0, (key,), shape)
        colour = caption.split()[2]
        if colour not in colours:
            colours.add(colour)
            rendered.append((frames, caption))
        if len(rendered) == n:
            return [f for f, _ in rendered], [c for _, c in rendered]
    raise AssertionError("the renderer drew fewer than n colours in 100 clips")


def test_readme_answers_right_only_for_the_clips_own_captions():
    frames, captions = _clips()
    assert len(set(captions)) == 4 and all("moving" in c for c in captions)
    own = readme_answers([frames], captions)
    assert [len(v) for v in own.values()] == [1] * 4
    assert all(v[0]["all"] and set(v[0]) == {"colour", "shape", "motion", "all"} for v in own.values())
    assert prompts_shown(own) == 4
    swapped = readme_answers([frames[1:] + frames[:1]], captions)  # each clip under another's caption
    assert all(v[0]["colour"] != p.split()[2] and not v[0]["all"] for p, v in swapped.items())
    assert prompts_shown(swapped) == 0


def test_prompts_shown_counts_the_share_of_seeds():
    frames, captions = _clips()
    answers = readme_answers([frames, frames[1:] + frames[:1]], captions)  # seed 0 right, seed 1 mostly wrong
    assert [[a["all"] for a in v] for v in answers.values()] == [[True, False]] * 4
    assert prompts_shown(answers, min_share=0.5) == 4  # one seed of two is half
    assert prompts_shown(answers, min_share=0.75) == 0


def test_save_frames_one_row_per_video(tmp_path):
    videos = np.random.default_rng(0).integers(0, 255, (3, 8, 32, 32, 3), dtype=np.uint8)
    img = np.asarray(Image.open(save_frames(videos, str(tmp_path / "f.png"), scale=1)))
    assert img.shape == (3 * 34, 4 * 34, 3)
    np.testing.assert_array_equal(img[1:33, 1:33], videos[0, 0])  # row 0, frame 1
    for col, frame in enumerate((0, 2, 5, 7)):  # 0, T//3, 2T//3, T-1
        np.testing.assert_array_equal(img[34 + 1 : 34 + 33, col * 34 + 1 : col * 34 + 33], videos[1, frame])


def test_train_command_saves_and_keeps_every_scored_step():
    for run in (*RUNS, Run("odd", 3000, (1500, 2500, 3000))):
        cmd = train_command(run, "w", "tiny-motion", ["model.dtype=float32"])
        opts = dict(a.split("=", 1) for a in cmd if a.startswith("train."))
        every, keep = int(opts["train.ckpt_every"]), int(opts["train.keep_checkpoints"])
        assert int(opts["train.steps"]) == run.steps and cmd[-1] == "model.dtype=float32"
        assert all(step % every == 0 for step in run.score)  # a checkpoint is written at each scored step
        assert keep >= run.steps // every  # and rotation deletes none of them
    with pytest.raises(ValueError, match="score steps"):
        train_command(Run("late", 1000, (2000,)), "w", "tiny-motion", [])


def test_every_run_is_a_valid_config_and_the_default_is_the_steps_study():
    from dsv_jax.config import get_config
    from experiments.tiny_steps import DEFAULT_RUNS

    assert len({r.name for r in RUNS}) == len(RUNS)
    assert DEFAULT_RUNS == ("steps2000", "steps3000", "steps4000", "steps8000", "steps16000")
    for run in RUNS:  # the overrides a run trains with, checked as `dsv-jax train` checks them
        cmd = train_command(run, "w", "tiny-motion", [])
        cfg = get_config("tiny-motion", [a for a in cmd[cmd.index("--no-progress") + 1 :]])
        assert cfg.train.steps == run.steps
        for override in run.overrides:
            key, value = override.split("=", 1)
            section, field = key.split(".")
            assert str(getattr(getattr(cfg, section), field)) == value
