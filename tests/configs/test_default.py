"""configs/default.py: its variants and key=value overrides, and the errors of bad ones."""

import pytest

from configs import default


def test_variants_and_overrides():
    assert default.get_config("post").model.norm == "post"
    config = default.get_config("pre,lr=3e-3,model.n_layers=24,steps=50,model.tie_embeddings=true")
    assert config.model.norm == "pre"
    assert config.opt.lr == pytest.approx(3e-3) and isinstance(config.opt.lr, float)
    assert config.model.n_layers == 24 and isinstance(config.model.n_layers, int)
    assert config.train.steps == 50
    assert config.model.tie_embeddings is True


def test_later_tokens_win():
    assert default.get_config("pre,norm=post").model.norm == "post"


@pytest.mark.parametrize("arg,message", [
    ("sandwich", "unknown config variant 'sandwich'"),
    ("model.n_layer=3", "unknown config key 'model.n_layer'"),
    ("nosection.x=1", "no section 'nosection'"),
    ("layers=2.5", "expected int"),
    ("lr=fast", "expected float"),
    ("model.tie_embeddings=maybe", "expected a boolean"),
    ("model=3", "'model' is a config section, not a field: set one of its fields, e.g. model."),
])
def test_bad_arguments_name_the_problem(arg, message):
    with pytest.raises(ValueError, match=message):
        default.get_config(arg)
