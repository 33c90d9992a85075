"""The tie-aware comparison the end-to-end checks use (token_match.judge)."""
from mooncake_connector.token_match import judge


def test_identical():
    assert judge([1, 2, 3], [], [1, 2, 3])[0] == "identical"


def test_parting_at_a_tie_is_accepted_and_said():
    v, note = judge([1, 2, 3, 4], [[-0.1, -2], [-0.5, -0.5], [-1, -3], [0, -1]],
                    [1, 9, 8, 7], eps=0.01)
    assert v == "tie" and "token 1" in note and "accepted" in note


def test_parting_where_the_reference_was_sure_fails():
    v, note = judge([1, 2, 3], [[-0.1, -2], [-0.01, -4.0], [-1, -3]], [1, 9, 3], eps=0.01)
    assert v == "differs" and "token 1" in note and "gap" in note


def test_parting_without_logprobs_fails():
    assert judge([1, 2, 3], [], [1, 9, 3])[0] == "differs"


def test_a_shorter_output_fails():
    v, note = judge([1, 2, 3], [[0, 0]] * 3, [1, 2])
    assert v == "differs" and "lengths" in note
