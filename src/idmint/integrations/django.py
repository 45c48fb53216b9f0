"""Integer primary keys from an idmint key, as a Django model field.

    from idmint.integrations.django import IdmintField

    class Order(models.Model):
        id = IdmintField(key="order")   # store: settings.IDMINT_STORE, else $IDMINT_STORE

The field is a BigIntegerField primary key that, like an AutoField, is None on a new instance
and gets its id when the row is inserted: `save()`, `create()` and `bulk_create()` (an AutoField
gets it from the database, this one from the key's generator, in memory). A migration writes it
as `idmint.integrations.django.IdmintField(key="order", ...)`: the key's name and the name of the
setting holding the store URL, never the URL (it may hold a password), nor a bound method of a
generator, which a migration could not import.

`IdmintDefault(key)` is the same id source as a plain callable default, for another integer
field (Django calls a default when the instance is made, so such ids are taken then).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from django.db import models
from django.utils.deconstruct import deconstructible

from .._errors import InvalidArgument
from . import LazyGenerator

__all__ = ["DEFAULT_SETTING", "IdmintDefault", "IdmintField"]

#: The Django setting, and then the environment variable, naming the store URL.
DEFAULT_SETTING = "IDMINT_STORE"


@deconstructible
class IdmintDefault(LazyGenerator):
    """A callable default giving the next id of idmint key `key`, from the store whose URL is
    in Django setting `setting` (else the environment variable of that name; for the default
    IDMINT_STORE, else idmint.connect()'s default, sqlite:///./idmint.db). Read on the first
    id a process takes. Migrations write it as its import path with its arguments."""

    def __init__(self, key: str, setting: str = DEFAULT_SETTING) -> None:
        if not isinstance(setting, str) or not setting.isidentifier():
            raise InvalidArgument(f"setting names a Django setting, not {setting!r}")
        super().__init__(key)
        self.setting = setting

    def __call__(self) -> int:
        return self.get().next_id()

    def _url(self) -> str | None:
        from django.conf import settings

        url = getattr(settings, self.setting, None) or os.environ.get(self.setting)
        if url is None and self.setting != DEFAULT_SETTING:
            # A setting the model names on purpose: a missing one is a mistake, not the default.
            raise InvalidArgument(
                f"no idmint store for key {self.key!r}: set settings.{self.setting} (or the "
                f"{self.setting} environment variable) to a store URL"
            )
        if url is not None and not isinstance(url, str):
            raise InvalidArgument(f"settings.{self.setting} is a store URL, not {url!r}")
        return url


if TYPE_CHECKING:  # django-stubs' fields are generic (the types set and read), Django's not
    _BigIntegerField = models.BigIntegerField[int | None, int]
else:
    _BigIntegerField = models.BigIntegerField


class IdmintField(_BigIntegerField):
    """A BigIntegerField primary key filled from idmint key `key` when the row is inserted
    (see the module doc); KeyNotFound or StoreUnavailable from save() or bulk_create() when
    no id can be had, before anything is written. `setting`: see IdmintDefault."""

    description = "Integer id from an idmint key"

    def __init__(self, *args: Any, key: str, setting: str = DEFAULT_SETTING, **kwargs: Any) -> None:
        if "default" in kwargs:
            raise InvalidArgument("an IdmintField's ids come from its key: it takes no default")
        if not kwargs.setdefault("primary_key", True):
            raise InvalidArgument(
                "an IdmintField is a primary key; for another column use "
                f"models.BigIntegerField(default=IdmintDefault({key!r}))"
            )
        self.ids = IdmintDefault(key, setting)
        # A default (never called: get_default is None) makes save() insert at once, as for
        # a primary key with a default, instead of trying an UPDATE first.
        kwargs["default"] = self.ids
        kwargs["blank"] = True  # as an AutoField: full_clean() passes while the id is None
        super().__init__(*args, **kwargs)

    def get_default(self) -> None:
        # None on a new instance, as an AutoField: no id taken for objects never saved (or
        # for a form's initial value), and none taken before the insert.
        return None

    def get_pk_value_on_save(self, instance: models.Model) -> int:
        # Django asks this of a primary key that is None on save() and bulk_create().
        return self.ids()

    def formfield(self, **kwargs: Any) -> None:
        # As an AutoField: not in ModelForms (the admin), whose users cannot know an id.
        return None

    def deconstruct(self) -> tuple[str, str, Sequence[Any], dict[str, Any]]:
        name, _, args, kwargs = super().deconstruct()
        del kwargs["default"], kwargs["blank"]  # both set by __init__
        kwargs["key"] = self.ids.key
        if self.ids.setting != DEFAULT_SETTING:
            kwargs["setting"] = self.ids.setting
        return name, "idmint.integrations.django.IdmintField", args, kwargs
