"""Gossip averaging (Stochastic Gradient Push): topologies, mixing weights, gossipers and
the averager that the trainers use."""

from .graphs import GRAPHS, ExplicitGraph, Graph, make_graph
from .mixing import Mixing, UniformMixing

__all__ = ["GRAPHS", "ExplicitGraph", "Graph", "Mixing", "UniformMixing", "make_graph"]
