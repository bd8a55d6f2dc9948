"""Checkpoints on every entry point (tests/clusters/test_checkpoints.py), the recipe of
docs/checkpoints.md: ``straight`` trains 2N steps; ``first`` trains N steps and saves on rank 0
(gossip: averages first); ``second``, a new job, loads (on every rank, or on rank 0 and
broadcasts) and trains N more. Each rank reports its losses and trainable weights.

Data and initial values depend only on (step, rank) and the rank's seed, so the runs see the same
batches; ranks start from different seeds (the first step's broadcast, or the load, makes them
agree).
"""

from __future__ import annotations

import os

import mxnet as mx
import numpy as np
from job_tools import report, run
from mxnet import autograd, gluon
from mxnet.gluon import nn

import bps_gossip as core
import mxnet_plugin as bps

B, F, C = 8, 10, 4
# Adam where the states are one rank's (its update counters are state too: issue 46), SGD with
# momentum for gossip, where each rank's momentum is its own.
OPTIMIZERS = {"kvstore": "adam", "module": "adam", "allreduce": "adam", "gossip": "sgd", "async": "sgd"}
SETTINGS = {"adam": {"learning_rate": 0.01, "wd": 1e-4}, "sgd": {"learning_rate": 0.05, "momentum": 0.9, "wd": 1e-4}}
loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()


def batch(entry, step, rank):
    """Rank ``rank``'s batch at ``step`` (images for the CNN)."""
    rs = np.random.RandomState(1000 * step + rank)
    shape = (B, 3, 32, 32) if entry == "allreduce" else (B, F)
    return rs.standard_normal(shape).astype(np.float32), rs.randint(0, C, B).astype(np.float32)


def build(entry):
    """allreduce: a model-zoo CNN at 32x32; the others a small Dense network."""
    if entry == "allreduce":
        net = gluon.model_zoo.vision.mobilenet0_25(classes=C)
    else:
        net = nn.HybridSequential()
        net.add(nn.Dense(16, activation="relu", in_units=F), nn.Dense(C, in_units=16))
    net.initialize(mx.init.Xavier())
    net(mx.nd.array(batch(entry, 0, 0)[0]))  # shapes known (mobilenet's are deferred)
    return net


def trainer_of(entry, net):
    name = OPTIMIZERS[entry]
    if entry == "kvstore":
        return gluon.Trainer(net.collect_params(), name, SETTINGS[name], kvstore="bpsgossip")
    return bps.DistributedTrainer(net.collect_params(), name, SETTINGS[name], mode=entry)


def trainable(params):
    """Each trainable parameter's values (flattened, the first 64, and its norm)."""
    return {name: [float(np.linalg.norm(p.data().asnumpy()))] + p.data().asnumpy().ravel()[:64].tolist()
            for name, p in sorted(params.items()) if p.grad_req != "null"}


def gluon_steps(entry, net, trainer, steps, rank, size):
    losses = []
    for step in steps:
        x, y = batch(entry, step, rank)
        with autograd.record():
            loss = loss_fn(net(mx.nd.array(x)), mx.nd.array(y))
        loss.backward()
        trainer.step(B * size if entry == "kvstore" else B)  # the store sums, the trainer averages
        losses.append(float(loss.mean().asscalar()))
    return losses


def gluon_job(entry, phase, n, folder, load):
    rank, size = bps.rank(), bps.size()
    mx.random.seed(100 + rank)
    net = build(entry)
    trainer = trainer_of(entry, net)
    params_file, states_file = os.path.join(folder, "net.params"), os.path.join(folder, "trainer.states")
    own_states = f"{states_file}.{rank}"  # gossip, async: each rank's momentum is its own
    if phase == "second":
        if load == "every":  # a file system every rank reads
            net.load_parameters(params_file)
            trainer.load_states(own_states if entry in ("gossip", "async") else states_file)
        else:  # rank 0 reads, everyone gets its values
            if rank == 0:
                net.load_parameters(params_file)
            bps.broadcast_parameters(net.collect_params(), root_rank=0)
            bps.load_optimizer_states(trainer, states_file, root_rank=0)
    first = n if phase == "second" else 0
    losses = gluon_steps(entry, net, trainer, range(first, first + n), rank, size)
    if phase in ("first", "straight") and entry == "gossip":
        trainer.average_parameters()  # one model to save: every rank's average
    after = {}
    if entry == "async":  # every rank's last change in, then every rank takes the servers' weights
        core.barrier()
        trainer.flush()
        x, y = batch(entry, first + n, rank)  # the model saved, on the batch the next job starts with
        after = {"next_loss": float(loss_fn(net(mx.nd.array(x)), mx.nd.array(y)).mean().asscalar())}
    if phase == "first" and entry in ("gossip", "async"):
        trainer.save_states(own_states)
    if phase == "first" and rank == 0:
        net.save_parameters(params_file)
        trainer.save_states(states_file)
    if phase == "straight":
        losses += gluon_steps(entry, net, trainer, range(n, 2 * n), rank, size)
    return {"rank": rank, "losses": losses, "weights": trainable(net.collect_params()), **after}


def symbol():
    data = mx.sym.Variable("data")
    hidden = mx.sym.Activation(mx.sym.FullyConnected(data, num_hidden=16, name="fc1"), act_type="relu")
    return mx.sym.SoftmaxOutput(mx.sym.FullyConnected(hidden, num_hidden=C, name="fc2"), name="softmax")


def module_steps(module, steps, rank):
    losses = []
    for step in steps:
        x, y = batch("module", step, rank)
        module.forward(mx.io.DataBatch([mx.nd.array(x)], [mx.nd.array(y)]), is_train=True)
        probabilities = module.get_outputs()[0].asnumpy()
        losses.append(float(-np.log(probabilities[np.arange(B), y.astype(int)]).mean()))
        module.backward()
        module.update()
    return losses


def module_job(phase, n, folder, load):
    rank, size = bps.rank(), bps.size()
    prefix = os.path.join(folder, "module")
    module = mx.mod.Module(symbol(), context=mx.cpu())
    module.bind(data_shapes=[("data", (B, F))], label_shapes=[("softmax_label", (B,))])
    mx.random.seed(100 + rank)
    module.init_params(mx.init.Xavier())
    if phase == "second":
        arg_params, aux_params = module.get_params()
        if load == "every" or rank == 0:
            _, arg_params, aux_params = mx.model.load_checkpoint(prefix, n)
        if load == "root":
            bps.broadcast_parameters(arg_params, root_rank=0)
            bps.broadcast_parameters(aux_params, root_rank=0)
        module.set_params(arg_params, aux_params)
    name = OPTIMIZERS["module"]
    # MXNet's Module file holds the states without the optimizer, so not its update counters:
    # begin_num_update gives Adam's bias correction the steps already made (docs/checkpoints.md).
    resumed = {"begin_num_update": n} if phase == "second" else {}
    module.init_optimizer(kvstore="bpsgossip", optimizer=name,
                          optimizer_params={**SETTINGS[name], "rescale_grad": 1.0 / (B * size), **resumed})
    if phase == "second":
        if load == "every":
            module.load_optimizer_states(f"{prefix}-{n:04d}.states")
        else:
            bps.load_optimizer_states(module, f"{prefix}-{n:04d}.states", root_rank=0)
    first = n if phase == "second" else 0
    losses = module_steps(module, range(first, first + n), rank)
    if phase == "first" and rank == 0:
        module.save_checkpoint(prefix, n, save_optimizer_states=True)
    if phase == "straight":
        losses += module_steps(module, range(n, 2 * n), rank)
    arg_params, _ = module.get_params()
    weights = {name: [float(np.linalg.norm(v.asnumpy()))] + v.asnumpy().ravel()[:64].tolist()
               for name, v in sorted(arg_params.items())}
    return {"rank": rank, "losses": losses, "weights": weights}


def main(entry, phase, n, folder, load="every"):
    bps.init()
    if entry == "module":
        result = module_job(phase, int(n), folder, load)
    else:
        result = gluon_job(entry, phase, int(n), folder, load)
    report(result)
    bps.shutdown()


run({"run": main})
