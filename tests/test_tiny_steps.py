"""experiments/tiny_steps.py's scoring of the README prompts (the study itself runs on a GPU)."""

import numpy as np
from PIL import Image

from dsv_jax.data import synthetic
from experiments.tiny_steps import prompts_shown, readme_answers, save_frames


def _clips(n=4, shape=(8, 32, 32)):
    rendered = [synthetic.render(0, (i,), shape) for i in range(n)]
    return [f for f, _ in rendered], [c for _, c in rendered]


def test_readme_answers_right_only_for_the_clips_own_captions():
    frames, captions = _clips()
    assert len(set(captions)) == 4 and all("moving" in c for c in captions)
    own = readme_answers([frames], captions)
    assert [len(v) for v in own.values()] == [1] * 4
    assert all(v[0]["all"] and set(v[0]) == {"colour", "shape", "motion", "all"} for v in own.values())
    assert prompts_shown(own) == 4
    swapped = readme_answers([frames[1:] + frames[:1]], captions)  # each clip under another's caption
    assert prompts_shown(swapped) < 4


def test_prompts_shown_counts_the_share_of_seeds():
    frames, captions = _clips()
    answers = readme_answers([frames, frames[1:] + frames[:1]], captions)  # seed 0 right, seed 1 mostly wrong
    wrong_in_seed_1 = sum(not v[1]["all"] for v in answers.values())
    assert wrong_in_seed_1 >= 1
    assert prompts_shown(answers, min_share=0.5) == 4  # one seed of two is half
    assert prompts_shown(answers, min_share=1.0) == 4 - wrong_in_seed_1


def test_save_frames_one_row_per_video(tmp_path):
    videos = np.random.default_rng(0).integers(0, 255, (3, 8, 32, 32, 3), dtype=np.uint8)
    img = np.asarray(Image.open(save_frames(videos, str(tmp_path / "f.png"), scale=1)))
    assert img.shape == (3 * 34, 4 * 34, 3)
    np.testing.assert_array_equal(img[1:33, 1:33], videos[0, 0])  # row 0, frame 1
    np.testing.assert_array_equal(img[34 + 1:34 + 33, 3 * 34 + 1:3 * 34 + 33], videos[1, 7])  # row 1, frame 8
