"""Every process group bytecheckpoint makes on a subgroup is named alike on all its members,
whatever groups each member made before (see ``runtime/comm.gloo_group_of``): the gloo twin of
an NCCL-only group (``_control_group``) and the manager's agreement group. A member that counted
one group more than the others used to wait for them under another name until the timeout."""

from __future__ import annotations

from tests.support import group_workloads as g


def test_the_gloo_twin_of_an_nccl_subgroup_is_named_alike_on_its_members(world):
    assert world(4).run(g.control_twin_of_an_nccl_subgroup) == [None, [1, 2], [1, 2], None]


def test_the_agreement_group_of_a_subgroup_is_named_alike_on_its_members(world):
    assert world(4).run(g.agreement_on_a_subgroup) == [None, (True, False), (True, False), None]
