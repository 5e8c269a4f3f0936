"""Main job: `python -m keras_dvi` trains and evaluates a DVI network on the bundled toy data.

Prints the test error and checks the deterministic predictive moments against 20,000 Monte
Carlo weight samples at a few inputs.
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m keras_dvi", description=__doc__)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    import keras_dvi
    from keras_dvi import DenseDVI, datasets

    keras.utils.set_random_seed(args.seed)
    (x_train, y_train), (x_test, y_test) = datasets.load_toy_regression()

    def expected_squared_error(y_true, y_pred):
        mean, var = keras_dvi.unpack(y_pred, covariance="diagonal")
        return keras.ops.mean(keras.ops.square(y_true - mean[:, 0]) + var[:, 0])

    model = keras.Sequential(
        [keras.Input((1,)), DenseDVI(64, "relu"), DenseDVI(64, "relu"), DenseDVI(1)]
    )
    model.compile(keras.optimizers.Adam(3e-3), loss=expected_squared_error)
    start = time.perf_counter()
    model.fit(x_train, y_train, epochs=args.epochs, batch_size=100, verbose=0)
    seconds = time.perf_counter() - start

    mean, var = keras_dvi.unpack(model.predict(x_test, verbose=0), covariance="diagonal")
    rmse = float(np.sqrt(np.mean((np.asarray(mean)[:, 0] - y_test) ** 2)))
    print(f"keras-dvi {keras_dvi.__version__}: DVI network 1-64-64-1 (ReLU) on the toy data")
    print(f"trained {args.epochs} epochs in {seconds:.1f} s; test RMSE {rmse:.4f}")

    probe = np.array([[-0.25], [0.0], [0.25]], dtype="float32")
    mean, var = keras_dvi.unpack(model(probe), covariance="diagonal")
    samples = keras_dvi.sample_outputs(model, probe, num_samples=20000, seed=1)[..., 0]
    print("x       DVI mean    MC mean     DVI sd      MC sd")
    for i, x in enumerate(probe[:, 0]):
        print(
            f"{x:5.2f}  {float(mean[i, 0]):10.4f}  {samples[:, i].mean():10.4f}  "
            f"{float(np.sqrt(var[i, 0])):10.4f}  {samples[:, i].std():10.4f}"
        )


if __name__ == "__main__":
    main()
