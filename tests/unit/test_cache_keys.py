"""A tenant's own Redis user's key patterns (`alma tenants redis-acl`): exact per
partition, its runs' keys only, glob characters of a tenant id escaped."""

from __future__ import annotations

from alma_core.storage.cache import partition_key, run_key, tenant_acl_rules, tenant_key_patterns


def test_a_tenants_patterns_name_each_partition_and_its_own_runs_only() -> None:
    patterns = tenant_key_patterns("alma", "acme", 3)
    assert len(patterns) == 9
    assert partition_key("alma", 2, "epoch") in patterns
    assert "{alma:0}:h:4:acme:*" in patterns
    assert "{alma:1}:inflight:4:acme:*" in patterns
    # acme2's keys carry its own length: no acme pattern is a prefix of them
    other = partition_key("alma", 0, f"h:{run_key('acme2', 'r')}")
    assert not any(other.startswith(p.rstrip("*")) for p in patterns if p.endswith("*"))


def test_glob_characters_of_a_tenant_id_are_escaped() -> None:
    patterns = tenant_key_patterns("alma", "a*[b]?", 1)
    assert "{alma:0}:h:6:a\\*\\[b\\]\\?:*" in patterns


def test_the_rules_allow_no_key_but_the_patterns_and_no_administration() -> None:
    rules = tenant_acl_rules("alma", "acme", 2)
    assert rules[:3] == ["on", "resetkeys", "resetchannels"]
    assert "-@all" in rules
    assert "-@dangerous" in rules
    assert [r for r in rules if r.startswith("~")] == [
        f"~{p}" for p in tenant_key_patterns("alma", "acme", 2)
    ]
