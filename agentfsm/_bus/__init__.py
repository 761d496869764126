"""The event bus: subscriptions with their own buffers, and the emitter loops
publish through (nothing outside this package touches the bus's internals)."""

from .bus import BusStatistics, EventBus, Subscription, SubscriptionStatistics
from .emitter import Emitter, EventType

__all__ = (
    "BusStatistics",
    "Emitter",
    "EventBus",
    "EventType",
    "Subscription",
    "SubscriptionStatistics",
)
