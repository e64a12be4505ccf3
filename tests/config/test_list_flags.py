"""The experiments' list flags (postnorm.config.list_flags): values as typed in the messages."""

import pytest
from absl import app

from postnorm.config.list_flags import choice_list, integer_list


def test_integer_lists():
    assert integer_list("seeds", ["0", "12", "-3"], -5) == [0, 12, -3]
    for values, message in [(["abc"], "--seeds=abc: each must be an integer in [0, 2**31)"),
                            (["-1"], "--seeds=-1: each must be an integer in [0, 2**31)"),
                            (["--5"], "--seeds=--5: each must be an integer"),
                            ([str(2**31)], "each must be an integer in [0, 2**31)"),
                            ([], "--seeds=: give one or more values, each once"),
                            (["0", "00"], "--seeds=0,00: give one or more values, each once")]:
        with pytest.raises(app.UsageError) as error:
            integer_list("seeds", values, 0)
        assert message in str(error.value)


def test_choice_lists():
    assert choice_list("norms", ["pre", "post"], ("post", "pre")) == ["pre", "post"]
    for values, message in [(["post", "bogus"], "--norms: 'bogus' is not one of post, pre"),
                            ([], "--norms=: give one or more values, each once"),
                            (["post", "post"], "--norms=post,post: give one or more values")]:
        with pytest.raises(app.UsageError) as error:
            choice_list("norms", values, ("post", "pre"))
        assert message in str(error.value)
