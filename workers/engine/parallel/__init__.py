"""Expert parallelism's mechanics inside one engine: process groups, dispatching tokens to the ranks that
hold their experts and combining the results, and applying a placement of experts to slots."""
