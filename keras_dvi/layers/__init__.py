"""Keras layers of keras-dvi."""

from keras_dvi.layers.base import BayesianLayer
from keras_dvi.layers.dense_diag_dvi import DenseDiagDVI
from keras_dvi.layers.dense_dvi import DenseDVI
from keras_dvi.layers.dense_mcvi import DenseMCVI
from keras_dvi.layers.global_inducing_dense import GlobalInducingDense
from keras_dvi.layers.homoscedastic_noise import HomoscedasticNoise
from keras_dvi.layers.sampled_noise import SampledHomoscedasticNoise
from keras_dvi.layers.skip_dvi import SkipDiagDVI, SkipDVI
from keras_dvi.layers.target_scaling import TargetScaling

__all__ = ["BayesianLayer", "DenseDVI", "DenseDiagDVI", "SkipDVI", "SkipDiagDVI", "HomoscedasticNoise",
           "GlobalInducingDense", "SampledHomoscedasticNoise", "DenseMCVI", "TargetScaling"]
