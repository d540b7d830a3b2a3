"""SmartStage of subclassed models on torch: keras-rs's recommenders, their
lookups in their calls, train staged as their hand split does."""

import pytest

from tests.helpers import check_recommender_matches_hand_split


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", ["retrieval", "deep_retrieval", "dlrm"])
def test_recommender_subclass_matches_its_hand_split(name):
    check_recommender_matches_hand_split(name)
