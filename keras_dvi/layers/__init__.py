"""Keras layers of keras-dvi."""

from keras_dvi.layers.activation_dvi import ActivationDVI
from keras_dvi.layers.add_dvi import AddDVI
from keras_dvi.layers.attention_dvi import MultiHeadAttentionDVI
from keras_dvi.layers.base import BayesianLayer
from keras_dvi.layers.batch_normalization_dvi import BatchNormalizationDVI
from keras_dvi.layers.concatenate_dvi import ConcatenateDVI
from keras_dvi.layers.conv_dvi import (
    Conv1DDVI,
    Conv1DTransposeDVI,
    Conv2DDVI,
    Conv2DTransposeDVI,
    Conv3DDVI,
    Conv3DTransposeDVI,
)
from keras_dvi.layers.conv_mcvi import Conv1DMCVI, Conv2DMCVI
from keras_dvi.layers.dense_diag_dvi import DenseDiagDVI
from keras_dvi.layers.dense_dvi import DenseDVI
from keras_dvi.layers.dense_mcvi import DenseMCVI
from keras_dvi.layers.depthwise_conv_dvi import DepthwiseConv2DDVI
from keras_dvi.layers.flatten_dvi import FlattenDVI
from keras_dvi.layers.global_inducing_conv import GlobalInducingConv2D
from keras_dvi.layers.group_normalization_dvi import GroupNormalizationDVI
from keras_dvi.layers.global_inducing_dense import GlobalInducingDense
from keras_dvi.layers.global_inducing_dvi import GlobalInducingDenseDVI
from keras_dvi.layers.inducing_inputs import InducingInputs
from keras_dvi.layers.layer_normalization_dvi import LayerNormalizationDVI, RMSNormalizationDVI
from keras_dvi.layers.multiply_dvi import MultiplyDVI
from keras_dvi.layers.homoscedastic_noise import HomoscedasticNoise
from keras_dvi.layers.padding_dvi import (
    Cropping1DDVI,
    Cropping2DDVI,
    Cropping3DDVI,
    UpSampling1DDVI,
    UpSampling2DDVI,
    UpSampling3DDVI,
    ZeroPadding1DDVI,
    ZeroPadding2DDVI,
    ZeroPadding3DDVI,
)
from keras_dvi.layers.pooling_dvi import (
    AveragePooling1DDVI,
    AveragePooling2DDVI,
    AveragePooling3DDVI,
    GlobalAveragePooling1DDVI,
    GlobalAveragePooling2DDVI,
    GlobalAveragePooling3DDVI,
    GlobalMaxPooling1DDVI,
    GlobalMaxPooling2DDVI,
    GlobalMaxPooling3DDVI,
    MaxPooling1DDVI,
    MaxPooling2DDVI,
    MaxPooling3DDVI,
)
from keras_dvi.layers.reshape_dvi import ClassTokenDVI, PositionEmbeddingDVI, ReshapeDVI, SelectTokenDVI
from keras_dvi.layers.sampled_noise import SampledHomoscedasticNoise
from keras_dvi.layers.skip_dvi import SkipDiagDVI, SkipDVI
from keras_dvi.layers.target_scaling import TargetScaling

__all__ = ["BayesianLayer", "DenseDVI", "DenseDiagDVI", "SkipDVI", "SkipDiagDVI", "HomoscedasticNoise",
           "GlobalInducingDense", "GlobalInducingConv2D", "GlobalInducingDenseDVI", "InducingInputs", "SampledHomoscedasticNoise", "DenseMCVI", "TargetScaling",
           "Conv1DDVI", "Conv2DDVI", "Conv1DMCVI", "Conv2DMCVI", "MaxPooling1DDVI", "MaxPooling2DDVI",
           "AveragePooling1DDVI", "AveragePooling2DDVI", "GlobalAveragePooling1DDVI", "GlobalAveragePooling2DDVI",
           "GlobalMaxPooling1DDVI", "GlobalMaxPooling2DDVI",
           "FlattenDVI", "AddDVI", "ConcatenateDVI", "BatchNormalizationDVI", "LayerNormalizationDVI", "GroupNormalizationDVI", "RMSNormalizationDVI", "ZeroPadding1DDVI",
           "ZeroPadding2DDVI", "Cropping1DDVI", "Cropping2DDVI", "DepthwiseConv2DDVI", "ActivationDVI", "MultiplyDVI",
           "Conv1DTransposeDVI", "Conv2DTransposeDVI", "UpSampling1DDVI", "UpSampling2DDVI",
           "Conv3DDVI", "Conv3DTransposeDVI", "MaxPooling3DDVI", "AveragePooling3DDVI", "GlobalAveragePooling3DDVI", "GlobalMaxPooling3DDVI", "ZeroPadding3DDVI", "Cropping3DDVI", "UpSampling3DDVI",
           "MultiHeadAttentionDVI", "ReshapeDVI", "PositionEmbeddingDVI",
           "ClassTokenDVI", "SelectTokenDVI"]
