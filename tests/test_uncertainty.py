"""The evaluation suite against numpy / scikit-learn: Brier, reliability bins, temperature scaling,
selective prediction, OOD AUROC, diversity; the digits shifts and OOD set; TFDS shift sets on mock data."""

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from ipf_jax.config import read
from ipf_jax.data import shifts
from ipf_jax.data.errors import DataError
from ipf_jax.errors import ConfigError
from ipf_jax.evaluation import metrics
from ipf_jax.evaluation import results as results_lib
from ipf_jax.reporting import tables
from tests import helpers

pytestmark = pytest.mark.slow  # CI: leg 1 only (pytest.ini)


def random_probs(rng, n, c, sharp=3.0):
  logits = rng.normal(size=(n, c)) * sharp
  return np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)


def test_classification_sums_match_numpy():
  rng = np.random.default_rng(0)
  probs, labels = random_probs(rng, 300, 5), rng.integers(0, 5, 300)
  mask = (rng.random(300) < 0.9).astype(np.float32)
  out = metrics.finalize(
    metrics.classification_sums(jnp.asarray(probs, jnp.float32), jnp.asarray(labels), jnp.asarray(mask))
  )
  keep = mask > 0
  p, y = probs[keep], labels[keep]
  onehot = np.eye(5)[y]
  np.testing.assert_allclose(out["brier"], np.mean(np.sum((p - onehot) ** 2, -1)), rtol=1e-5)
  np.testing.assert_allclose(out["accuracy"], np.mean(p.argmax(-1) == y), rtol=1e-6)
  conf = p.max(-1)
  which = np.minimum((conf * 15).astype(int), 14)
  for b in range(15):
    sel = which == b
    assert out["reliability"][b, 0] == sel.sum()
    if sel.any():
      np.testing.assert_allclose(
        out["reliability"][b, 1:], [conf[sel].mean(), (p[sel].argmax(-1) == y[sel]).mean()], rtol=1e-5
      )
  # tempered: T = 1 is the prediction itself; T = 2 is softmax(log p / 2)
  one = int(np.argmin(np.abs(metrics.TEMPERATURES - 1.0)))
  assert metrics.TEMPERATURES[one] == 1.0
  np.testing.assert_allclose(out["nll_by_temperature"][one], out["nll"], rtol=1e-5)
  np.testing.assert_allclose(out["ece_by_temperature"][one], out["ece"], rtol=1e-4, atol=1e-6)
  two = int(np.argmin(np.abs(metrics.TEMPERATURES - 2.0)))
  soft = np.exp(np.log(p) / 2)
  soft /= soft.sum(-1, keepdims=True)
  np.testing.assert_allclose(out["nll_by_temperature"][two], -np.mean(np.log(soft[np.arange(len(y)), y])), rtol=1e-4)
  np.testing.assert_allclose(out["brier_by_temperature"][two], np.mean(np.sum((soft - onehot) ** 2, -1)), rtol=1e-4)


def probs_with_certainty(u, num_classes=3):
  """Probabilities whose maximum has certainty score ``u`` (``metrics.certainty``'s first score)."""
  conf = 1.0 - 10.0 ** (-metrics.CERTAINTY_DECADES * u)
  rest = (1.0 - conf) / (num_classes - 1)
  p = np.tile(rest[:, None], (1, num_classes))
  p[:, 0] = conf
  return p


def test_selective_accuracy_matches_sorting():
  """Every example in a bin of its own: accuracy of the k most certain examples, exactly."""
  n = 100
  rng = np.random.default_rng(1)
  u = 0.05 + 0.9 * (np.arange(n) + 0.5) / n  # distinct bins of 200, max prob >= 1/3
  u = rng.permutation(u)
  probs = probs_with_certainty(u)
  labels = np.where(rng.random(n) < 0.7, 0, 1)  # class 0 is predicted: correct 70% of the time
  out = metrics.finalize(metrics.classification_sums(jnp.asarray(probs, jnp.float32), jnp.asarray(labels), jnp.ones(n)))
  correct = (labels == 0)[np.argsort(-u)]
  expected = np.cumsum(correct) / np.arange(1, n + 1)  # coverage k / 100
  np.testing.assert_allclose(out["selective_accuracy"], expected, rtol=1e-5)
  np.testing.assert_allclose(out["selective_auc"], expected.mean(), rtol=1e-5)


def test_auroc_matches_sklearn_and_counts_ties_half():
  from sklearn.metrics import roc_auc_score

  rng = np.random.default_rng(2)
  k = metrics.NUM_CERTAINTY_BINS
  in_bins, out_bins = rng.integers(0, 4, k).astype(float), rng.integers(0, 4, k).astype(float)
  scores = np.concatenate([np.repeat(np.arange(k), in_bins.astype(int)), np.repeat(np.arange(k), out_bins.astype(int))])
  is_in = np.concatenate([np.ones(int(in_bins.sum())), np.zeros(int(out_bins.sum()))])
  np.testing.assert_allclose(metrics.auroc(in_bins, out_bins), roc_auc_score(is_in, scores), rtol=1e-10)
  # through the sums: in-distribution examples more certain than every OOD one -> 1; swapped -> 0
  sums = lambda u: metrics.finalize(
    metrics.classification_sums(
      jnp.asarray(probs_with_certainty(u), jnp.float32), jnp.zeros(len(u), jnp.int32), jnp.ones(len(u))
    )
  )
  hi, lo = sums(np.linspace(0.6, 0.9, 20)), sums(np.linspace(0.1, 0.4, 30))
  for score in (0, 1):  # max probability, entropy
    assert metrics.auroc(hi["certainty_counts"][score], lo["certainty_counts"][score]) == 1.0
    assert metrics.auroc(lo["certainty_counts"][score], hi["certainty_counts"][score]) == 0.0


def test_diversity_matches_pairwise_loops():
  rng = np.random.default_rng(3)
  p, n, c = 5, 40, 4
  probs = np.stack([random_probs(rng, n, c, sharp=1.5) for _ in range(p)])
  alive = np.array([1, 1, 0, 1, 1], np.float32)
  probs_nan = probs.copy()
  probs_nan[2] = np.nan  # a culled particle reaches no metric
  out = metrics.finalize_diversity(
    metrics.diversity_sums(jnp.asarray(probs_nan, jnp.float32), jnp.asarray(alive), jnp.ones(n), lambda x: x)
  )
  live = [i for i in range(p) if alive[i]]
  pairs = [(i, j) for i, j in itertools.permutations(live, 2)]
  disagree = np.mean([np.mean(probs[i].argmax(-1) != probs[j].argmax(-1)) for i, j in pairs])
  kl = np.mean([np.mean(np.sum(probs[i] * (np.log(probs[i]) - np.log(probs[j])), -1)) for i, j in pairs])
  np.testing.assert_allclose(out["disagreement"], disagree, rtol=1e-5)
  np.testing.assert_allclose(out["pairwise_kl"], kl, rtol=1e-4)
  one = metrics.finalize_diversity(
    metrics.diversity_sums(jnp.asarray(probs[:1], jnp.float32), jnp.ones(1), jnp.ones(n), lambda x: x)
  )
  assert one == {"disagreement": 0.0, "pairwise_kl": 0.0}


def test_temperature_scaled_picks_the_calibration_minimum():
  t = metrics.TEMPERATURES
  curve = lambda best: (np.log(t) - np.log(best)) ** 2 + 0.3
  calibration = {"ensemble": {"nll_by_temperature": curve(2.0)}, "fused": {"nll_by_temperature": curve(0.5)}}
  test = {
    k: {
      "nll": 1.0,
      "ece": 0.1,
      "brier": 0.2,
      **{f"{m}_by_temperature": np.arange(len(t)) * 1.0 + i for i, m in enumerate(("nll", "ece", "brier"))},
    }
    for k in ("ensemble", "fused")
  }
  out = results_lib.temperature_scaled(calibration, test)
  i2, i05 = int(np.argmin(np.abs(t - 2.0))), int(np.argmin(np.abs(t - 0.5)))
  assert out["ensemble"] == {"temperature": 2.0, "nll": i2, "ece": i2 + 1, "brier": i2 + 2, "at_grid_edge": False}
  assert out["fused"]["temperature"] == 0.5 and out["fused"]["nll"] == i05
  calibration["fused"]["nll_by_temperature"] = curve(20.0)  # beyond the grid: its edge, said so
  assert results_lib.temperature_scaled(calibration, test)["fused"]["at_grid_edge"]


def test_digits_corruptions_are_deterministic_and_grow_with_severity():
  x = helpers.digits_data().test["image"][:64]
  for c in shifts.DIGITS_CORRUPTIONS:
    distance = []
    for s in shifts.SEVERITIES:
      a, b = shifts.corrupt_digits(x, c, s), shifts.corrupt_digits(x, c, s)
      np.testing.assert_array_equal(a, b)
      assert a.shape == x.shape and a.dtype == np.float32 and a.min() >= 0 and a.max() <= 1
      distance.append(np.abs(a - x).mean())
    assert distance[0] > 0 and all(d2 > d1 for d1, d2 in zip(distance, distance[1:])), (c, distance)
  photos = shifts.photo_patches(100)
  np.testing.assert_array_equal(photos, shifts.photo_patches(100))
  assert photos.shape == (100, 8, 8, 1) and photos.min() == 0 and photos.max() == 1
  assert len({p.tobytes() for p in photos}) == 100


def test_shift_and_ood_config_errors_name_the_field():
  config = helpers.tiny_config(eval_shifts="gaussian_noise,fog")
  with pytest.raises(ConfigError, match="config.eval_shifts: fog not known for dataset 'digits'"):
    read.eval_sets(config, helpers.digits_data())
  config = helpers.tiny_config(ood_dataset="svhn_cropped")
  with pytest.raises(ConfigError, match="config.ood_dataset: 'svhn_cropped' is not available for digits"):
    read.ood_sets(config, helpers.digits_data())
  config = helpers.tiny_config(eval_shifts="all")
  assert sorted(read.eval_sets(config, helpers.digits_data())) == sorted(
    f"{c}_{s}" for c in shifts.DIGITS_CORRUPTIONS for s in shifts.SEVERITIES
  )


def test_tfds_shift_and_ood_sets_on_mock_data(tmp_path):
  import tensorflow_datasets as tfds

  from ipf_jax.data import tfds_input

  config = helpers.tiny_config(dataset="cifar10", eval_shifts="contrast,cifar10_1", ood_dataset="svhn_cropped")
  with tfds.testing.mock_data(num_examples=12):
    data = tfds_input.TFDSDataset("cifar10", None, 32, small_images=True)
    sets = read.eval_sets(config, data)
    assert sorted(sets) == ["cifar10_1"] + [f"contrast_{s}" for s in shifts.SEVERITIES]
    assert sets["contrast_3"].name == "cifar10_corrupted/contrast_3" and sets["contrast_3"].split == "test"
    (ood,) = read.ood_sets(config, data).values()
    for source in (sets["contrast_5"], sets["cifar10_1"], ood):
      batches = list(source.eval_batches(5))
      assert [len(b["image"]) for b in batches] == [5, 5, 2] and source.test_size == 12
      assert batches[0]["image"].shape == (5, 32, 32, 3) and batches[0]["image"].dtype == np.float32
  # without prepared data: one error naming the field and how to prepare it
  with pytest.raises(DataError, match=r"config.eval_shifts / ood_dataset: .*cifar10_1.*tfds build cifar10_1"):
    tfds_input.TFDSEvalSet("cifar10_1", "test", data)


def test_imagenet_shift_sets_on_mock_data():
  """ImageNet's shifted test sets: ImageNet-C (``imagenet2012_corrupted``, its validation split), ImageNet-V2, -A
  and -R (their test splits), read and preprocessed like imagenet2012's eval split. (The mock has no split
  metadata, so it cannot tell a real split name from a wrong one: the table below is what pins them.)"""
  import tensorflow_datasets as tfds

  from ipf_jax.data import tfds_input

  config = helpers.tiny_config(dataset="imagenet2012", eval_shifts="gaussian_noise,imagenet_v2,imagenet_a,imagenet_r")
  with tfds.testing.mock_data(num_examples=6):
    data = tfds_input.TFDSDataset("imagenet2012", None, 16)
    sets = read.eval_sets(config, data)
    assert sorted(sets) == [f"gaussian_noise_{s}" for s in shifts.SEVERITIES] + [
      "imagenet_a",
      "imagenet_r",
      "imagenet_v2",
    ]
    expected = {
      **{
        f"gaussian_noise_{s}": (f"imagenet2012_corrupted/gaussian_noise_{s}", "validation") for s in shifts.SEVERITIES
      },
      **{n: (n, "test") for n in ("imagenet_v2", "imagenet_a", "imagenet_r")},
    }
    assert {n: (source.name, source.split) for n, source in sets.items()} == expected
    for name in ("gaussian_noise_5", "imagenet_v2", "imagenet_a", "imagenet_r"):
      batches = list(sets[name].eval_batches(4))
      assert [len(b["image"]) for b in batches] == [4, 2] and sets[name].test_size == 6, name
      assert batches[0]["image"].shape == (4, 16, 16, 3) and batches[0]["image"].dtype == np.float32
      assert 0 <= batches[0]["label"].min() and batches[0]["label"].max() < 1000  # the 1000 ImageNet classes
  with pytest.raises(DataError, match=r"config.eval_shifts / ood_dataset: .*imagenet_a"):
    tfds_input.TFDSEvalSet("imagenet_a", "test", data)


def test_temperature_fitted_on_overconfident_predictions_undoes_it():
  """Labels drawn from softmax(z), predictions softmax(2 z): the fitted temperature is about 2."""
  rng = np.random.default_rng(4)
  z = rng.normal(size=(4000, 6)) * 1.5
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  labels = np.array([rng.choice(6, p=row) for row in p])
  sharp = np.exp(2 * z) / np.exp(2 * z).sum(-1, keepdims=True)
  results = {
    "ensemble": metrics.finalize(
      metrics.classification_sums(jnp.asarray(sharp, jnp.float32), jnp.asarray(labels), jnp.ones(len(labels)))
    )
  }
  fitted = results_lib.temperature_scaled(results, results)["ensemble"]
  assert 2 / 1.2 < fitted["temperature"] < 2 * 1.2 and not fitted["at_grid_edge"]
  assert fitted["nll"] < results["ensemble"]["nll"] and fitted["ece"] < results["ensemble"]["ece"]


def _numpy_ece(probs, labels, bins=metrics.NUM_ECE_BINS):
  conf, correct = probs.max(-1), probs.argmax(-1) == labels
  which = np.minimum((conf * bins).astype(int), bins - 1)
  return sum(abs(correct[which == b].sum() - conf[which == b].sum()) for b in range(bins)) / len(labels)


def test_a_shifted_set_at_the_temperature_fitted_on_the_calibration_set():
  """``brief(shifted, calibration)``: each row's ECE, NLL and Brier on a shifted set at the temperature whose NLL
  is the lowest on the calibration set (not on the shifted set), against numpy on the tempered probabilities;
  the footer shows each row's mean over a corruption's severities."""
  rng = np.random.default_rng(5)
  softmax = lambda z: np.exp(z) / np.exp(z).sum(-1, keepdims=True)

  def results(z, scales):  # labels drawn from softmax(z); row k predicts softmax(scales[k] z)
    labels = np.array([rng.choice(5, p=row) for row in softmax(z)])
    probs = {k: softmax(scale * z) for k, scale in scales.items()}
    out = {
      k: metrics.finalize(
        metrics.classification_sums(jnp.asarray(p, jnp.float32), jnp.asarray(labels), jnp.ones(len(labels)))
      )
      for k, p in probs.items()
    }
    return {**out, "weights": np.ones(2) / 2}, probs, labels

  calibration, _, _ = results(rng.normal(size=(3000, 5)), {"ensemble": 2.0, "fused": 0.5})  # T near 2 and 0.5
  fitted = results_lib.temperature_scaled(calibration, calibration)
  assert 2 / 1.2 < fitted["ensemble"]["temperature"] < 2 * 1.2 and 0.5 / 1.2 < fitted["fused"]["temperature"] < 0.6
  footer = {}
  for severity, spread in ((1, 0.5), (2, 0.3)):  # a shift: less certain inputs, the models sharper still
    shifted, probs, labels = results(rng.normal(size=(2000, 5)) * spread, {"ensemble": 3.0, "fused": 1.5})
    out = results_lib.brief(shifted, calibration)
    for row in ("ensemble", "fused"):
      t = out["temperature_scaled"][row]
      assert t["temperature"] == fitted[row]["temperature"]
      tempered = probs[row] ** (1 / t["temperature"])
      tempered /= tempered.sum(-1, keepdims=True)
      np.testing.assert_allclose(t["ece"], _numpy_ece(tempered, labels), atol=1e-5)
      np.testing.assert_allclose(t["nll"], -np.mean(np.log(tempered[np.arange(len(labels)), labels])), rtol=1e-4)
      np.testing.assert_allclose(out[row]["ece"], _numpy_ece(probs[row], labels), atol=1e-5)
      footer.setdefault(row, []).append(t["ece"])
    assert out["temperature_scaled"]["ensemble"]["ece"] < out["ensemble"]["ece"]
    assert "ece_by_temperature" not in out["ensemble"] and "temperature_scaled" not in results_lib.brief(shifted)
    footer.setdefault("sets", {})[f"contrast_{severity}"] = out
  text = tables.format_extras(
    {"weights": np.ones(2) / 2, "shifts": footer["sets"]},
    (("accuracy", "accuracy", "{:.4f}"), ("ECE", "ece", "{:.4f}")),
  )
  assert "ensemble accuracy  ensemble ECE  ensemble ECE at T  fused accuracy  fused ECE  fused ECE at T" in text
  cells = text.splitlines()[-1].split()
  assert cells[0] == "contrast" and cells[3] == f"{np.mean(footer['ensemble']):.4f}"
  assert cells[6] == f"{np.mean(footer['fused']):.4f}"


def test_selective_with_ties_and_a_particle_axis():
  """Two particles: one bin holding every example (ties: accuracy is the bin's at every coverage), and
  examples in two bins (the certain bin first, then linear within the other)."""
  bins = np.zeros((2, metrics.NUM_CERTAINTY_BINS, 2))
  bins[0, 10] = (40, 30)  # 40 tied examples, 30 correct
  bins[1, 150] = (20, 20)  # 20 certain, all correct
  bins[1, 5] = (20, 10)  # 20 uncertain, half correct
  accuracy, area = metrics.selective(bins)
  np.testing.assert_allclose(accuracy[0], 0.75)
  c = metrics.COVERAGES
  expected = np.where(c <= 0.5, 1.0, (20 + (c * 40 - 20) * 0.5) / (c * 40))
  np.testing.assert_allclose(accuracy[1], expected, rtol=1e-12)
  np.testing.assert_allclose(area, [0.75, expected.mean()])


def test_labels_outside_the_classes_are_never_correct():
  probs = jnp.asarray([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
  out = metrics.finalize(metrics.classification_sums(probs, jnp.asarray([-1, 5, 1]), jnp.ones(3)))
  np.testing.assert_allclose(out["accuracy"], 1 / 3)


def test_extras_for_regression_and_sets_without_severities():
  """The footer and the shift picture take the metrics a task has; cifar10_1 is a set, not a severity."""
  reg = {"nll": 1.2, "rmse": 0.5}
  results = {
    "weights": np.ones(4) / 4,
    "ensemble": reg,
    "fused": reg,
    "shifts": {"gaussian_noise_1": {"ensemble": reg, "fused": reg}, "cifar10_1": {"ensemble": reg, "fused": reg}},
  }
  columns = (("NLL", "nll", "{:.4f}"), ("RMSE", "rmse", "{:.4f}"))
  text = tables.format_extras(results, columns)
  assert "ensemble NLL  ensemble RMSE  fused NLL  fused RMSE" in text
  assert [line.split()[0] for line in text.splitlines()[1:]] == ["gaussian_noise", "cifar10_1"]
  assert shifts.family("cifar10_1") == ("cifar10_1", 0) and shifts.family("contrast_3") == ("contrast", 3)


def test_calibration_is_held_out_before_label_noise_and_names_the_data(tmp_path):
  from ipf_jax.runtime import trainer

  config = helpers.tiny_config(calibration_fraction=0.1, label_noise=0.5)
  noisy = read.dataset(config)
  clean = helpers.digits_data().holdout(0.1)
  np.testing.assert_array_equal(noisy.calibration.test["label"], clean.calibration.test["label"])
  assert noisy.train_size == clean.train_size == 1212 and (noisy.train["label"] != clean.train["label"]).mean() > 0.4
  assert noisy.name == "digits (0.1 held out)" != helpers.digits_data().name  # a checkpoint of other data: refused
  from ipf_jax.runtime import compatibility  # ... naming the field to put back

  with pytest.raises(
    compatibility.CheckpointError,
    match=r"this run reads 'digits' \(config.calibration_fraction is "
    r"0.1 there and 0.0 here\)\. Run with the checkpoint's values",
  ):
    plain = helpers.tiny_config()
    compatibility.check_compatible(
      {}, plain.to_dict() | {"calibration_fraction": 0.1}, {}, plain, "w", saved_data=noisy.name, data="digits"
    )
  older = {k: v for k, v in plain.to_dict().items() if k != "calibration_fraction"}  # a config without the field
  with pytest.raises(compatibility.CheckpointError, match=r"\(config.calibration_fraction is absent there and 0.1 "):
    compatibility.check_compatible(
      {}, older, {}, helpers.tiny_config(calibration_fraction=0.1), "w", saved_data="digits", data=noisy.name
    )
  config = helpers.tiny_config(eval_shifts="blur")
  with pytest.raises(ConfigError, match="config.eval_shifts: the shifted and OOD sets are those of config.dataset"):
    trainer._Run(config, str(tmp_path / "w"), for_training=False, data=helpers.digits_data())
  assert not (tmp_path / "w").exists()
