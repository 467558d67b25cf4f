"""Problems with nn.RNN (tanh, relu), nn.LSTM and nn.GRU: Sequential models and custom forwards."""

import torch
from torch import nn

from backpack.custom_module.reduce_tuple import ReduceTuple
from problems import Problem, randn

#: the recurrent layers' weights get Kronecker factors ("expand": steps act as samples, so G is
#: not the GGN block of a bias)
KRON = {"first", "second", "kron"}
SEQ = {"bias_block_is_G": False}


def seq_rnn(nonlinearity="tanh"):
    """RNN (batch_first) -> sequence output -> flatten -> Linear."""
    return nn.Sequential(
        nn.RNN(3, 4, nonlinearity=nonlinearity, batch_first=True),
        ReduceTuple(0),
        nn.Flatten(),
        nn.Linear(5 * 4, 3),
    )


def seq_lstm():
    """LSTM (batch_first) -> sequence output -> flatten -> Linear."""
    return nn.Sequential(
        nn.LSTM(3, 4, batch_first=True), ReduceTuple(0), nn.Flatten(), nn.Linear(4 * 4, 3)
    )


class ReluRNNTimeMajor(nn.Module):
    """ReLU RNN on a time-major input `[T, N, in]`; the head reads every step's output."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(3, 4, nonlinearity="relu")
        self.head = nn.Linear(4 * 4, 3)

    def forward(self, x):
        out, _ = self.rnn(x)
        return self.head(out.transpose(0, 1).flatten(1))


class DeepBidirectionalLSTM(nn.Module):
    """Two-layer bidirectional LSTM without bias on `[T, N, in]`; reads h_n and the output."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 2, num_layers=2, bidirectional=True, bias=False)
        self.head = nn.Linear(2 * 2 + 2 * 2, 3)

    def forward(self, x):
        out, (h_n, _) = self.lstm(x)
        summary = torch.cat([h_n[-2], h_n[-1]], 1)  # last layer, both directions
        return self.head(torch.cat([summary, out.mean(0)], 1))


class DeepBidirectionalRNN(nn.Module):
    """Two-layer bidirectional tanh RNN (batch_first), read through its final hidden states."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(2, 3, num_layers=2, bidirectional=True, batch_first=True)
        self.head = nn.Linear(4 * 3, 2)

    def forward(self, x):
        _, h_n = self.rnn(x)
        return self.head(h_n.transpose(0, 1).flatten(1))


class LSTMWithInitialState(nn.Module):
    """LSTM whose initial state (h0, c0) is computed from the first step; uses h_n and c_n."""

    def __init__(self):
        super().__init__()
        self.init_h = nn.Linear(3, 4)
        self.init_c = nn.Linear(3, 4)
        self.lstm = nn.LSTM(3, 4, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        first = x[:, 0]
        h0 = torch.tanh(self.init_h(first)).unsqueeze(0)
        c0 = self.init_c(first).unsqueeze(0)
        _, (h_n, c_n) = self.lstm(x, (h0, c0))
        return self.head(torch.cat([h_n[0], c_n[0]], 1))


class RNNWithInitialStateKwarg(nn.Module):
    """Time-major tanh RNN whose initial state (from the last step's input) is passed as `hx=`."""

    def __init__(self):
        super().__init__()
        self.init = nn.Linear(2, 3)
        self.rnn = nn.RNN(2, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h0 = torch.sigmoid(self.init(x[-1])).unsqueeze(0)
        out, h_n = self.rnn(x, hx=h0)
        return self.head(out[-1] + h_n[0])


def seq_lstm_inplace():
    """LSTM (batch_first: its output is a transposed view) -> in-place ReLU -> Linear."""
    return nn.Sequential(
        nn.LSTM(3, 4, batch_first=True),
        ReduceTuple(0),
        nn.ReLU(inplace=True),
        nn.Flatten(),
        nn.Linear(4 * 4, 3),
    )


def seq_gru():
    """GRU (batch_first) -> sequence output -> flatten -> Linear."""
    return nn.Sequential(
        nn.GRU(3, 4, batch_first=True), ReduceTuple(0), nn.Flatten(), nn.Linear(4 * 4, 3)
    )


class DeepBidirectionalGRU(nn.Module):
    """Two-layer bidirectional GRU on `[T, N, in]` with an initial state from the first step."""

    def __init__(self, bias=True):
        super().__init__()
        self.init = nn.Linear(3, 4 * 2)
        self.gru = nn.GRU(3, 2, num_layers=2, bidirectional=True, bias=bias)
        self.head = nn.Linear(2 * 2 + 2 * 2, 3)

    def forward(self, x):
        h0 = torch.tanh(self.init(x[0])).reshape(-1, 4, 2).transpose(0, 1).contiguous()
        out, h_n = self.gru(x, h0)
        summary = torch.cat([h_n[-2], h_n[-1]], 1)
        return self.head(torch.cat([summary, out.mean(0)], 1))


class Cells(nn.Module):
    """LSTMCell, GRUCell and RNNCell unrolled by hand over `[N, T, in]` (torch.func fallback).

    LSTMCell's h is computed from its c inside the call, and both feed the next step.
    """

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTMCell(3, 4)
        self.gru = nn.GRUCell(4, 3)
        self.rnn = nn.RNNCell(3, 2, nonlinearity="relu")
        self.head = nn.Linear(2 + 4, 3)

    def forward(self, x):
        state = None
        for t in range(x.shape[1]):
            state = self.lstm(x[:, t], state)
        h = self.gru(state[0])
        h = self.gru(torch.tanh(state[1]), h)
        return self.head(torch.cat([self.rnn(h), state[1]], 1))


class NestedOutputs(nn.Module):
    """A parametrized module returning (y, softmax(y)): one output computed from the other."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 3) / 2)

    def forward(self, x):
        y = x @ self.weight.T
        return y, torch.softmax(y, 1)


class UsesNestedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.nested = NestedOutputs()
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        y, p = self.nested(x)
        return self.head(torch.cat([y, p], 1))


PROBLEMS = [
    Problem("rnn-tanh-seq-ce-mean", seq_rnn, randn(4, 5, 3), tags=KRON, options=SEQ),
    Problem(
        "rnn-tanh-seq-mse-sum", seq_rnn, randn(3, 5, 3), lambda: nn.MSELoss(reduction="sum"),
        tags=KRON, options=SEQ,
    ),
    Problem(
        "rnn-relu-timemajor-ce-sum", ReluRNNTimeMajor, randn(4, 4, 3),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
    ),
    Problem("lstm-seq-ce-mean", seq_lstm, randn(4, 4, 3), tags=KRON, options=SEQ),
    Problem(
        "lstm-seq-mse-mean", seq_lstm, randn(3, 4, 3), lambda: nn.MSELoss(),
        tags=KRON, options=SEQ,
    ),
    Problem(
        "lstm-seq-inplace-relu-mse-sum", seq_lstm_inplace, randn(3, 4, 3),
        lambda: nn.MSELoss(reduction="sum"), tags={"first", "second"},
        # cuDNN's LSTM backward reads its output, which the in-place ReLU overwrites: plain
        # autograd refuses this model on CUDA (torch's own kernel, on the CPU, saves gates)
        options={"not_on_cuda": "cuDNN's LSTM saves the output the in-place ReLU overwrites"},
    ),
    Problem(
        "lstm-timemajor-2layer-bidir-nobias-mse-sum", DeepBidirectionalLSTM, randn(3, 4, 3),
        lambda: nn.MSELoss(reduction="sum"),
    ),
    Problem("rnn-tanh-2layer-bidir-hn-ce-mean", DeepBidirectionalRNN, randn(4, 3, 2)),
    Problem(
        "lstm-initial-state-ce-sum", LSTMWithInitialState, randn(4, 3, 3),
        lambda: nn.CrossEntropyLoss(reduction="sum"),
    ),
    Problem(
        "rnn-initial-state-kwarg-mse-mean", RNNWithInitialStateKwarg, randn(3, 4, 2),
        lambda: nn.MSELoss(),
    ),
    Problem("gru-seq-ce-mean", seq_gru, randn(4, 4, 3), tags=KRON, options=SEQ),
    Problem(
        "gru-timemajor-2layer-bidir-initial-state-mse-sum", DeepBidirectionalGRU, randn(3, 4, 3),
        lambda: nn.MSELoss(reduction="sum"), tags=KRON, options=SEQ,
    ),
    Problem(
        "gru-timemajor-2layer-bidir-nobias-ce-sum", lambda: DeepBidirectionalGRU(bias=False),
        randn(4, 3, 3), lambda: nn.CrossEntropyLoss(reduction="sum"),
    ),
    Problem("cells-unrolled-ce-mean", Cells, randn(4, 3, 3), tags={"first", "second", "reuse"}),
    Problem(
        "module-with-nested-outputs-mse-sum", UsesNestedOutputs, randn(5, 3),
        lambda: nn.MSELoss(reduction="sum"), tags={"first", "second"},
    ),
]
