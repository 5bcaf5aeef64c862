"""``/v1/reports``: reproducibility reports an account saved (``boxd rl verify --save``);
the console draws them (docs/console.md)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response, status

from boxd import models
from boxd.api.auth import Account
from boxd.api.errors import ERROR_RESPONSES
from boxd.api.routes._deps import check_name
from boxd.errors import NotFound
from boxd.services import ReportService

router = APIRouter(prefix="/reports", tags=["reports"], responses=ERROR_RESPONSES)


def _reports(request: Request) -> ReportService:
    reports: ReportService = request.app.state.reports
    return reports


Reports = Annotated[ReportService, Depends(_reports)]


@router.post("", response_model=models.Report, status_code=status.HTTP_201_CREATED)
async def save_report(body: models.ReportSave, account: Account,
                      reports: Reports) -> models.Report:
    """Save a report under a name (saving a name again replaces its report)."""
    check_name(body.name)
    return await reports.save(account, body)


@router.get("", response_model=models.ReportList)
async def list_reports(account: Account, reports: Reports) -> models.ReportList:
    """The account's reports, newest first (their verdicts; GET one for the whole)."""
    return models.ReportList(reports=await reports.list(account))


@router.get("/{name}", response_model=models.ReportData)
async def get_report(name: str, account: Account, reports: Reports) -> models.ReportData:
    """A report whole, as it was saved."""
    _named(name)
    return await reports.get(account, name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, response_class=Response)
async def delete_report(name: str, account: Account, reports: Reports) -> Response:
    """Delete a report."""
    _named(name)
    await reports.delete(account, name)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def _named(name: str) -> None:
    """A name no report can have names none: 404, as an unknown one (a path is a
    reference, not a new name; a save's bad name is the 400).

    Raises:
        NotFound: ``name`` breaks the name rule.
    """
    if not models.NAME_RE.match(name):
        raise NotFound(f"no report {name[:80]!r}", kind="report", name=name[:80],
                       hint="`boxd rl verify ... --save NAME` saves one; names: "
                       + models.NAME_RULE)

