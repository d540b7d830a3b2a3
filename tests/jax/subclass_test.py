"""SmartStage of subclassed models on jax: keras-rs's recommenders, their
lookups in their calls, train staged as their hand split does."""

import pytest

from tests.helpers import check_recommender_matches_hand_split


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["retrieval", "deep_retrieval", "dlrm"])
def test_recommender_subclass_matches_its_hand_split(name):
    check_recommender_matches_hand_split(name)


def test_a_keras_model_tower_with_lookups_is_refused_naming_the_fix():
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_stage

    class Tower(keras.Model):  # not keras_stage.Model: not traced inline
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.lookup = keras.layers.StringLookup(vocabulary=["a", "b"])
            self.emb = keras.layers.Embedding(3, 4)

        def call(self, x):
            return self.emb(self.lookup(x))

    class Towered(keras_stage.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.stage = keras_stage.layers.StagedInput(name="stage")
            self.tower = Tower(name="tower")
            self.out = keras.layers.Dense(1, name="out")

        def call(self, x):
            return self.out(self.tower(self.stage(x)))

    model = Towered(name="towered")
    model.compile(optimizer="adam", loss="mse", smart_stage=True)
    data = tf.data.Dataset.from_tensor_slices(
        (np.array(["a", "b"] * 8), np.zeros((16, 1), "float32"))
    ).batch(8)
    with (
        pytest.warns(UserWarning),  # Keras's, building the tower
        pytest.raises(ValueError, match="as a keras_stage.Model"),
    ):
        model.fit(data, shuffle=False, verbose=0)
