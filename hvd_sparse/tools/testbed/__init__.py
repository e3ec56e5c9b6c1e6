"""An emulated cluster on one machine: a network namespace per host behind a switch namespace.

    hvd-sparse testbed up --workers 4 --aggregators 1 --rate 1gbit --mtu 9000
    hvd-sparse testbed run -- python train.py
    hvd-sparse testbed run --launcher torch -- python train_ddp.py
    hvd-sparse testbed set --loss 0.01 --host w2
    hvd-sparse testbed set --dup 0.05 --reorder 0.1 --host w1
    hvd-sparse testbed down

``topology`` names the hosts and keeps the state file, ``links`` builds the namespaces, veths
and rate caps (pyroute2), ``loss`` drops, duplicates and reorders frames on the switch
(nftables), ``launch`` runs the aggregators and one rank per worker host (Horovod under mpirun,
or torch.distributed), ``faults`` injects timed faults while a job runs, ``cli`` is the command
line. Needs root.
"""
from .topology import Host, Testbed

__all__ = ["Host", "Testbed"]
