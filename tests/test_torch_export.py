"""End to end: torch modules exported with their loss inside, gradients of every parameter
compared with torch autograd (relative error <= 1e-3), both exporters."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from .torch_models import compare_with_torch

# the dynamo export takes seconds (first use in a process more): slow; torchscript is the fast lane's
EXPORTERS = [pytest.param(False, 17, id="torchscript-17"), pytest.param(True, 18, id="dynamo-18", marks=pytest.mark.slow)]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(12, 32), nn.Linear(32, 32), nn.Linear(32, 5)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + F.leaky_relu(h, 0.1)
        return F.cross_entropy(self.fc3(h), y)


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_mlp_cross_entropy(dynamo, opset):
    compare_with_torch(MLP(), (torch.randn(6, 12), torch.randint(0, 5, (6,))), ["x", "y"], dynamo=dynamo, opset=opset)


def test_mlp_dynamic_batch_runs_other_batch_size():
    x, y = torch.randn(6, 12), torch.randint(0, 5, (6,))
    compare_with_torch(MLP(), (x, y), ["x", "y"], dynamo=False, opset=17, dynamic_batch=True,
                       feed_args=(torch.randn(9, 12), torch.randint(0, 5, (9,))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.bn2 = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 2 * 2, 4)

    def forward(self, x, y):
        h = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        h = F.avg_pool2d(F.silu(self.bn2(self.conv2(h))), 2)
        return F.cross_entropy(self.fc(torch.flatten(h, 1)), y)


@pytest.mark.parametrize(
    "dynamo,opset,train",
    [
        pytest.param(False, 17, True, id="torchscript-17-train"),
        pytest.param(False, 17, False, id="torchscript-17-eval"),
        # torch's dynamo exporter writes BatchNormalization in its inference form even for a
        # module in training mode; the builder puts it back in training mode
        # (dynamo-18-train stays in the fast lane: the one dynamo export there)
        pytest.param(True, 18, True, id="dynamo-18-train"),
        pytest.param(True, 18, False, id="dynamo-18-eval", marks=pytest.mark.slow),
    ],
)
def test_cnn_batchnorm(dynamo, opset, train):
    m = CNN()
    with torch.no_grad():  # distinct values: exporters deduplicate identical initializers
        for t in list(m.parameters()) + [b for n, b in m.named_buffers() if "running" in n]:
            t.add_(0.1 * torch.rand_like(t))
    m.train(train)
    x = torch.randn(4, 3, 16, 16)
    compare_with_torch(m, (x, torch.randint(0, 4, (4,))), ["x", "y"], dynamo=dynamo, opset=opset)


class Encoder(nn.Module):
    def __init__(self, vocab=50, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=False)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d, 3)

    def forward(self, tokens, y):
        h = self.enc(self.emb(tokens))
        return F.cross_entropy(self.head(h.mean(1)), y)


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_transformer_encoder(dynamo, opset):
    m = Encoder()
    compare_with_torch(m, (torch.randint(0, 50, (3, 7)), torch.randint(0, 3, (3,))), ["tokens", "y"],
                       dynamo=dynamo, opset=opset)


class Decoder(nn.Module):
    def __init__(self, vocab=40, d=32):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, 8, d) * 0.1)
        self.layer = nn.TransformerDecoderLayer(d, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.out = nn.Linear(d, vocab)

    def forward(self, tokens, memory, target):
        t = tokens.shape[1]
        h = self.emb(tokens) + self.pos[:, :t]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.layer(h, memory, tgt_mask=mask)
        return F.cross_entropy(self.out(h).reshape(-1, self.out.out_features), target.reshape(-1))


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_transformer_decoder(dynamo, opset):
    args = (torch.randint(0, 40, (2, 6)), torch.randn(2, 5, 32), torch.randint(0, 40, (2, 6)))
    compare_with_torch(Decoder(), args, ["tokens", "memory", "target"], dynamo=dynamo, opset=opset)


class UnrolledRNN(nn.Module):
    """LSTM and GRU cells unrolled over time in Python, as exporters flatten them."""

    def __init__(self, d=6, h=8):
        super().__init__()
        self.lstm = nn.LSTMCell(d, h)
        self.gru = nn.GRUCell(h, h)
        self.h = h

    def forward(self, x, target):
        b = x.shape[0]
        hx = cx = gx = torch.zeros(b, self.h)
        outs = []
        for t in range(x.shape[1]):
            hx, cx = self.lstm(x[:, t], (hx, cx))
            gx = self.gru(hx, gx)
            outs.append(gx)
        return F.mse_loss(torch.stack(outs, 1), target)


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_unrolled_recurrent_cells(dynamo, opset):
    args = (torch.randn(3, 4, 6), torch.randn(3, 4, 8))
    compare_with_torch(UnrolledRNN(), args, ["x", "target"], dynamo=dynamo, opset=opset)


class Misc(nn.Module):
    """Ops the exporters emit for everyday code: norms, softmax, pads, slicing, cumsum, triu."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        self.ln = nn.LayerNorm(6)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm1d(4, affine=True)

    def forward(self, x):
        h = self.ln(x * self.w)
        h = self.gn(h.unsqueeze(0)).squeeze(0) + self.inorm(h.unsqueeze(0)).squeeze(0)
        h = torch.cat([h[:, :3].softmax(-1), F.log_softmax(h[:, 3:], -1)], dim=1)
        h = F.pad(h, (1, 2)) + 0.1
        h = torch.cumsum(h, dim=1) + torch.triu(h.t() @ h)[:, :1].t()
        h = F.hardswish(h) + F.softplus(h) + F.elu(h) + torch.clamp(h, -0.5, 0.5) + h.pow(2) / (1 + h.abs())
        return ((h * h + 1).sqrt().sum() + F.hardsigmoid(h).mean()) / (1 + torch.sigmoid(h).max())


@pytest.mark.parametrize("dynamo,opset", EXPORTERS)
def test_everyday_ops(dynamo, opset):
    compare_with_torch(Misc(), (torch.randn(4, 6),), ["x"], dynamo=dynamo, opset=opset)
