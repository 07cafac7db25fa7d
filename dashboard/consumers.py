"""The live feed behind the dashboard: the telemetry collector's group messages, forwarded to viewers."""

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.telemetry.collector import GROUP as TELEMETRY_GROUP
from dashboard.access import can_view_dashboard


class TelemetryConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        # Closing before accepting rejects the handshake (HTTP 403), so nothing is ever sent to outsiders.
        if not await database_sync_to_async(can_view_dashboard)(self.scope.get("user")):
            await self.close()
            return
        await self.channel_layer.group_add(TELEMETRY_GROUP, self.channel_name)
        await self.accept()

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(TELEMETRY_GROUP, self.channel_name)

    async def telemetry_update(self, event: dict) -> None:
        await self.send_json({"snapshot": event["snapshot"]})
