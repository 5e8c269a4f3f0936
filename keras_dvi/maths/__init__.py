"""The mathematics of keras-dvi: pure functions of `keras.ops` tensors, no layers and no state,
shared by every layer. Each module cites the paper's equations it implements and is tested
against an independent oracle (Monte Carlo over the weights, quadrature, closed forms).

* `moments` (`keras_dvi.moments`): dense layers under deterministic variational inference (Wu
  et al., ICLR 2019): linear maps of means and covariances, the Gaussian moments of ReLU and
  Heaviside activations, their cross-covariances, the heteroscedastic and softmax losses'
  expectations.
* `conv_moments` (`keras_dvi.conv_moments`): the same for feature maps (convolutions with the
  shared component a shared kernel induces between positions, Clark's max for max pooling,
  average pooling, flatten, addition).
* `attention` (`keras_dvi.attention`): multi-head attention (the pattern at the means, the
  map linearised about them; the head outputs' covariance through the output projection).
* `inducing` (`keras_dvi.inducing`): the global inducing posterior (Ober & Aitchison, ICML
  2021, eq. 11), its samples, log densities and KL.
* `tagi` (`keras_dvi.tagi.maths`): TAGI's closed-form updates (Goulet et al., JMLR 2021) and
  each layer's linear map with its adjoints.
"""

from keras_dvi.maths import attention, conv_moments, inducing, moments, tagi

__all__ = ["attention", "conv_moments", "inducing", "moments", "tagi"]
