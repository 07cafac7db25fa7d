"""Which addresses an image URL may be fetched from: public unicast ones, and the private networks an
operator names (SLUICE_IMAGE_FETCH_ALLOWED_NETWORKS), never a cloud metadata address.

deepseek-recipe's ReqwestImageFetcher takes a destination filter but ships none ("the caller writes
the rule"); this is the rule, used by recipe.images.fetch.
"""

import ipaddress
from collections.abc import Callable, Sequence

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# Cloud instance-metadata endpoints. Both are also covered by the ranges below (link-local, unique
# local); they are named so that a change to those checks cannot let them through.
METADATA_ADDRESSES = frozenset(
    {
        ipaddress.ip_address("169.254.169.254"),  # AWS, GCP, Azure, OpenStack
        ipaddress.ip_address("fd00:ec2::254"),  # AWS over IPv6
        ipaddress.ip_address("100.100.100.200"),  # Alibaba Cloud
    }
)


def is_public_address(address: IpAddress) -> bool:
    """False for private, loopback, link-local, unique-local, multicast, unspecified, reserved, shared
    (100.64/10) and metadata addresses, IPv4 or IPv6; an IPv4-mapped or -translated IPv6 address is
    judged by its IPv4 address."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = address.ipv4_mapped or _nat64_embedded(address) or address.sixtofour
        if embedded is not None:
            return is_public_address(embedded)
        if address.teredo is not None:
            return False
    if address in METADATA_ADDRESSES or address.is_multicast:
        return False
    # is_global is False for every special-purpose range of the IANA registries (private, loopback,
    # link-local, unique local, unspecified, reserved, documentation, shared address space).
    return address.is_global


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _nat64_embedded(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def address_filter(allowed_networks: Sequence[str]) -> Callable[[IpAddress], bool]:
    """Public addresses, and those in `allowed_networks` (CIDRs an operator trusts) except metadata
    addresses, which no setting opens."""
    networks = tuple(ipaddress.ip_network(network) for network in allowed_networks)
    if not networks:
        return is_public_address

    def is_allowed(address: IpAddress) -> bool:
        if address in METADATA_ADDRESSES:
            return False
        return is_public_address(address) or any(
            address.version == network.version and address in network for network in networks
        )

    return is_allowed
